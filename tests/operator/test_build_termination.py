"""`kiln build` writes its failure's cause where Kubernetes reads a container's termination
message, so the operator can put it in the InferenceEngine's status."""

import argparse

import pytest

build_cli = pytest.importorskip("kiln.runtime.build_cli")


def run(*argv):
    return build_cli.run_build(build_cli.add_build_args(argparse.ArgumentParser()).parse_args(list(argv)))


def test_failure_cause_goes_to_an_existing_termination_log(tmp_path):
    log = tmp_path / "termination-log"
    log.write_text("")
    assert run("--output", str(tmp_path / "e"), "--quantization", "int3", "--termination-log", str(log)) == 2
    text = log.read_text()
    assert text.startswith("kiln build: ") and "int3" in text


def test_no_termination_log_is_created_where_none_exists(tmp_path):
    log = tmp_path / "termination-log"
    assert run("--output", str(tmp_path / "e"), "--group-size", "7", "--quantization", "int4-awq",
               "--termination-log", str(log)) == 2
    assert not log.exists()
