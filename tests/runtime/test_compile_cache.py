"""The serving pods' Triton cache folder (kiln.runtime.compile_cache): used when writable,
replaced by a private temporary folder (with a warning) when not, never a failed start."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile

from kiln.runtime.compile_cache import ensure_writable_cache_dir, prepare_shared_cache


def test_writable_cache_dir_is_created_and_kept(tmp_path):
    env = {"TRITON_CACHE_DIR": str(tmp_path / "claim" / "triton")}
    assert ensure_writable_cache_dir(env) == str(tmp_path / "claim" / "triton")
    assert (tmp_path / "claim" / "triton").is_dir()
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "claim" / "triton")
    assert list((tmp_path / "claim" / "triton").iterdir()) == []  # the write test leaves nothing


def test_unwritable_cache_dir_falls_back_with_a_warning(tmp_path, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    env = {"TRITON_CACHE_DIR": str(blocker / "triton")}  # cannot be created (root ignores modes)
    with caplog.at_level(logging.WARNING, logger="kiln.runtime.compile_cache"):
        got = ensure_writable_cache_dir(env)
    assert got != str(blocker / "triton") and env["TRITON_CACHE_DIR"] == got
    assert os.path.isdir(got) and os.access(got, os.W_OK)
    assert "is not writable (a part of the path is not a folder)" in caplog.text
    assert str(blocker / "triton") in caplog.text
    caplog.clear()
    env = {"TRITON_CACHE_DIR": str(blocker)}  # the path itself is a file
    with caplog.at_level(logging.WARNING, logger="kiln.runtime.compile_cache"):
        ensure_writable_cache_dir(env)
    assert "(it is not a folder)" in caplog.text


def test_fallback_folder_is_removed_at_exit(tmp_path):
    """The private fallback folder does not outlive the process (a real interpreter exit)."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code = ("import os; from kiln.runtime.compile_cache import ensure_writable_cache_dir; "
            "env = {'TRITON_CACHE_DIR': os.environ['X'] + '/t'}; print(ensure_writable_cache_dir(env))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "X": str(blocker)}, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out.startswith(tempfile.gettempdir()) and "kiln-triton-cache-" in out
    assert not os.path.exists(out)


def test_unset_leaves_tritons_default():
    env: dict[str, str] = {}
    assert ensure_writable_cache_dir(env) is None and env == {}
    assert prepare_shared_cache(env) is None


def test_shared_cache_folder_is_group_writable(tmp_path):
    path = tmp_path / ".compile-cache"
    assert prepare_shared_cache({"KILN_COMPILE_CACHE_DIR": str(path)}) == str(path)
    assert path.stat().st_mode & 0o7777 == 0o2775
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert prepare_shared_cache({"KILN_COMPILE_CACHE_DIR": str(blocker / "c")}) is None  # logged, not raised
