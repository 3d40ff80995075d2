# Kiln developer entry points.  `make demo` and `make test` are the README's two commands.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python

.PHONY: setup demo demo-down demo-runtime test test-fast test-e2e serve clean
setup: $(VENV)/.kiln-installed

$(VENV)/.kiln-installed: pyproject.toml requirements/lock.txt
	bash .ci/setup-venv.sh
	touch $@

# The whole product on the embedded default: test control plane + process-backed node, helm
# install, kubectl apply examples/smollm2.yaml, engine build Job, rollout, one chat completion
# through the Service with the openai client.  Leaves the plane up; `make demo-down` stops it.
demo: setup
	$(VPY) -m kiln.devcluster.demo

demo-down:
	$(VPY) -m kiln.devcluster.demo --down-only

# The runtime alone: `kiln serve` on the embedded default and one chat request.
demo-runtime: setup
	$(VPY) -m kiln.runtime.demo

test: setup
	$(VPY) -m pytest -q --durations=25

test-fast: setup
	$(VPY) -m pytest -q -m "not slow and not cluster and not e2e"

test-e2e: setup
	$(VPY) -m pytest -q -m e2e tests/e2e

serve: setup
	$(VENV)/bin/kiln serve

clean:
	rm -rf $(VENV) build *.egg-info

# The development Kubernetes control plane (cluster-build, cluster-up, ...): devcluster/.
-include devcluster/cluster.mk
