"""Where the development cluster's files are: this repository, the `devcluster/` folder (build
script, Go wrapper modules, pinned versions) and the repository's virtual environment."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[3]  # devcluster/kiln/devcluster/paths.py -> the repository
DEVCLUSTER = REPO / "devcluster"
BUILD_SH = DEVCLUSTER / "build.sh"
VENV_BIN = REPO / ".venv" / "bin"
