"""The ``kiln`` command's subcommand table: every subcommand is in the parser, and one that
cannot import what it needs fails in one line naming the missing module (never "invalid
choice", never a traceback)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kiln.runtime.cli import EXIT_MISSING_MODULE, SUBCOMMANDS, build_parser

# Runs ``kiln.runtime.cli.main(ARGV)`` in a fresh interpreter where importing BLOCKED (or a
# submodule of it) fails as it does when the package is not installed.
_BLOCKED_RUN = """
import sys

BLOCKED, ARGV = sys.argv[1], sys.argv[2:]


class Block:
    def find_spec(self, name, path=None, target=None):
        if name == BLOCKED or name.startswith(BLOCKED + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Block())
from kiln.runtime.cli import main

sys.exit(main(ARGV))
"""


def run_blocked(blocked: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCKED_RUN, blocked, *argv], capture_output=True, text=True,
                          timeout=120)


def test_table_names_each_subcommand_once_and_the_parser_has_them_all():
    names = [c.name for c in SUBCOMMANDS]
    assert sorted(names) == sorted(set(names)) == ["adapter", "bench", "build", "engines", "eval", "head", "operator",
                                                   "router", "serve"]
    choices = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert list(choices) == names


@pytest.mark.parametrize("blocked, argv, extra", [
    ("torch", ["build", "--output", "{tmp}/eng", "--quantization", "int4-awq"], "runtime"),
    ("kiln.runtime.build_cli", ["build", "--output", "{tmp}/eng"], "runtime"),
    ("kiln.operator", ["operator", "--help"], "operator"),
])
def test_a_subcommand_that_cannot_import_says_which_module(tmp_path, blocked, argv, extra):
    r = run_blocked(blocked, *[a.format(tmp=tmp_path) for a in argv])
    assert r.returncode == EXIT_MISSING_MODULE != 0, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr and "invalid choice" not in r.stderr, r.stderr
    assert lines[0].startswith(f"kiln {argv[0]}: error: cannot import module '{blocked}'"), lines[0]
    assert f"kiln[{extra}]" in lines[0]
    assert not (tmp_path / "eng").exists()


def test_a_subcommand_whose_flags_cannot_import_stays_in_the_help():
    r = run_blocked("kiln.runtime.build_cli", "--help")
    assert r.returncode == 0, r.stderr
    assert "build" in r.stdout and "quantize and compile a model into an engine" in r.stdout


@pytest.mark.parametrize("argv", [["serve", "--port", "abc"], ["serve", "--num-speculative-tokens", "abc"],
                                  ["nope"], ["bench", "offline", "--quantization", "int3"]])
def test_a_usage_error_is_one_line_with_exit_2(argv, capsys):
    from kiln.runtime.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert ": error: " in err[0] and err[0].endswith("--help)"), err[0]
