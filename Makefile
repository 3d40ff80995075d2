# Kiln developer entry points.  `make demo` and `make test` are the README's two commands.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python

.PHONY: setup demo test test-fast serve clean
setup: $(VENV)/.kiln-installed

$(VENV)/.kiln-installed: pyproject.toml requirements/lock.txt
	bash .ci/setup-venv.sh
	touch $@

demo: setup
	$(VPY) -m kiln.runtime.demo

test: setup
	$(VPY) -m pytest -q

test-fast: setup
	$(VPY) -m pytest -q -m "not slow and not cluster and not e2e"

serve: setup
	$(VENV)/bin/kiln serve

clean:
	rm -rf $(VENV) build *.egg-info

# The test Kubernetes control plane (issue: control plane), owned by tests/cluster/.
-include tests/cluster/cluster.mk
