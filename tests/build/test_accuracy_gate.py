"""kiln build's accuracy gate (build.accuracyGate): a tiny random Llama measured against its
source with kiln eval agreement; a failing engine leaves nothing, a passing one keeps its
numbers in the manifest and the build's report."""

from __future__ import annotations

import argparse

from kiln.common.enginecache import parse_build_report
from kiln.common.manifest import read_manifest, verify_engine
from kiln.runtime.build_cli import add_build_args, run_build


def _args(*argv):
    return add_build_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_a_failing_engine_is_refused_and_a_passing_one_keeps_its_numbers(tiny_model, tmp_path, capsys):
    term = tmp_path / "term"
    term.write_text("")
    out = tmp_path / "e-int4"
    rc = run_build(_args("--model", str(tiny_model), "--output", str(out), "--quantization", "int4-gptq",
                         "--group-size", "32", "--calibration-samples", "2", "--device", "cpu",
                         "--max-perplexity-increase", "0", "--min-greedy-agreement", "1", "--gate-prompts", "2",
                         "--termination-log", str(term)))
    err = capsys.readouterr().err
    assert rc == 3 and not out.exists(), err
    msg = term.read_text()
    assert msg.startswith("kiln build: AccuracyGateFailed: ") and "perplexity" in msg, msg
    assert "[evaluate " in err  # the stage the operator shows
    term.write_text("")
    ok = tmp_path / "e-none"
    rc = run_build(_args("--model", str(tiny_model), "--output", str(ok), "--quantization", "none", "--device", "cpu",
                         "--max-perplexity-increase", "0.01", "--min-greedy-agreement", "0.9", "--gate-prompts", "2",
                         "--termination-log", str(term)))
    assert rc == 0, capsys.readouterr().err
    acc = read_manifest(ok)["accuracy"]
    verify_engine(ok, verify_checksums=True)  # the manifest's digest covers the numbers
    assert acc["perplexityIncrease"] <= 0.01 and acc["greedyAgreement"] >= 0.9 and acc["numPrompts"] == 2
    report = parse_build_report(term.read_text())
    assert report["accuracy"] == acc and report["bytes"] > 0


def test_bad_gate_bounds_are_refused(tmp_path, capsys):
    assert run_build(_args("--output", str(tmp_path / "e"), "--min-greedy-agreement", "1.5")) == 2
    assert "--min-greedy-agreement must be in [0, 1]" in capsys.readouterr().err
    assert run_build(_args("--output", str(tmp_path / "e"), "--max-perplexity-increase", "-0.1")) == 2
