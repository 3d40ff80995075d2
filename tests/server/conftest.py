"""A real `kiln serve` process for the server tests (helpers in kiln_server.py)."""

from __future__ import annotations

import pytest

from kiln_server import start_server, stop_server


@pytest.fixture(scope="session")
def server():
    s = start_server("--max-num-seqs", "64", "--max-model-len", "2048")
    yield s
    stop_server(s)
