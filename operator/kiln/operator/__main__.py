"""``python -m kiln.operator ...`` (the same as ``kiln operator ...``)."""

import sys

from .main import run

sys.exit(run(sys.argv[1:]))
