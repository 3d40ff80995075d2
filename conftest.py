# Repo-wide pytest plugins.
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "cluster"))
pytest_plugins = ["plane_fixtures"]
