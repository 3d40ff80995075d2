"""User errors of ``kiln serve`` and ``kiln bench serve`` end in one clear line and a non-zero
exit, before any model is loaded (no model is loaded here)."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kiln.runtime.cli import main


@pytest.fixture
def openai_stub():
    """A server that lists model ``stub`` and answers every completion with a 400 error
    body; ``received`` collects the request bodies."""
    received: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, status: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(200, {"object": "list", "data": [{"id": "stub", "object": "model"}]})

        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self._send(400, {"error": {"message": "this model's maximum context length is 4096 tokens",
                                       "type": "invalid_request_error", "param": None, "code": None}})

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", received
    srv.shutdown()
    srv.server_close()


@pytest.mark.parametrize("url", ["http://127.0.0.1:1", "notaurl"])
def test_bench_serve_unreachable_url(url, capsys):
    assert main(["bench", "serve", "--url", url, "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert f"kiln bench: error: cannot reach the server at {url}: " in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_bench_serve_reports_why_requests_failed(openai_stub, capsys):
    url, received = openai_stub
    assert main(["bench", "serve", "--url", url, "--num-prompts", "2", "--input-len", "8", "--output-len", "2"]) == 1
    out = capsys.readouterr()
    assert "400: this model's maximum context length is 4096 tokens" in out.err

    def no_nan(c):
        raise AssertionError(f"invalid JSON constant {c}")

    summary = json.loads(out.out.splitlines()[0], parse_constant=no_nan)
    assert summary["errors"] == 2 and summary["ttft_p50_s"] is None
    assert summary["first_error"] == "400: this model's maximum context length is 4096 tokens"
    assert [r["model"] for r in received] == ["stub", "stub"]


def test_bench_serve_model_names_the_requests_model(openai_stub, capsys):
    url, received = openai_stub
    main(["bench", "serve", "--url", url, "--model", "other", "--num-prompts", "1", "--input-len", "4"])
    assert [r["model"] for r in received] == ["other"]


def test_serve_port_in_use_fails_before_loading_the_model(monkeypatch, capsys):
    from kiln.runtime import engine

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(engine, "LLMEngine", no_load)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--host", "127.0.0.1", "--port", str(port)]) == 2
    assert f"port {port} on 127.0.0.1 is in use" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["", "   "])
def test_serve_empty_served_model_name_is_refused_before_loading(monkeypatch, capsys, name):
    from kiln.runtime import engine

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(engine, "LLMEngine", no_load)
    assert main(["serve", "--host", "127.0.0.1", "--port", "0", "--served-model-name", name]) == 2
    assert "--served-model-name must not be empty" in capsys.readouterr().err


@pytest.mark.parametrize("args,msg", [
    (["--served-model-name", " my/model "], "no leading or trailing spaces"),
    (["--served-model-name", "my\nmodel"], "no leading or trailing spaces and no control characters"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be between 0 and 3600"),
])
def test_serve_bad_name_or_shutdown_timeout_refused_before_loading(monkeypatch, capsys, args, msg):
    from kiln.runtime import engine

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(engine, "LLMEngine", no_load)
    assert main(["serve", "--host", "127.0.0.1", "--port", "0", *args]) == 2
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize("args,msg", [
    (["--tensor-parallel-size", "2", "--speculative-method", "ngram"],
     "speculative decoding is not served with --tensor-parallel-size > 1"),
    (["--speculative-method", "draft"], "speculative method draft needs --speculative-model"),
    (["--speculative-method", "eagle"], "speculative method eagle needs --speculative-model"),
    (["--speculative-method", "ngram", "--speculative-model", "builtin:smollm2-135m-instruct"],
     "speculative method ngram uses no model"),
    (["--speculative-method", "ngram", "--num-speculative-tokens", "17"], "--num-speculative-tokens must be"),
    # n-gram and switch-off flags without a method (or the window with a model-based method)
    # would be accepted and ignored
    (["--prompt-lookup-min", "3"], "need --speculative-method"),
    (["--prompt-lookup-max", "3"], "need --speculative-method"),
    (["--speculative-disable-by-batch-size", "3"], "need --speculative-method"),
    (["--speculative-method", "draft", "--speculative-model", "builtin:smollm2-135m-instruct",
      "--prompt-lookup-max", "3"], "apply to speculative method ngram only"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be at least 1"),
    (["--lora-dir", "/tmp"], "--lora-dir applies to LoRA serving: add --enable-lora"),
])
def test_serve_unsupported_speculation_is_one_line_and_exit_2_before_loading(monkeypatch, capsys, args, msg):
    """What the operator refuses as InvalidSpec (kiln.operator.speculative), kiln serve refuses
    too, at once: a pod given such flags ends in one line, not a traceback after the load."""
    from kiln.runtime import engine

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(engine, "LLMEngine", no_load)
    assert main(["serve", "--host", "127.0.0.1", "--port", "0", "--device", "cpu", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1, err


def test_serve_kv_cache_too_large_for_memory_is_a_clear_error(capsys):
    """A pool that cannot be allocated (here ~70 TB) is a one-line error naming the flag, not a
    traceback from the allocator."""
    assert main(["serve", "--host", "127.0.0.1", "--port", "0", "--num-kv-blocks", "100000000"]) == 2
    err = capsys.readouterr().err
    assert "does not fit in memory" in err and "--num-kv-blocks" in err and "Traceback" not in err, err[-2000:]
