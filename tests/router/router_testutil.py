"""Names the router tests share (a module of its own: ``from conftest import`` would pick up
whichever folder's conftest pytest imported first)."""

MODEL = "smollm2"  # the served model name of the test replicas
