# The test Kubernetes control plane (tests/cluster/): binaries built from source through the Go
# module proxy and cached under ~/.cache/kiln/cluster/<versions>/, run as plain processes.
#   make cluster-build    build or reuse the cached binaries (first time: see tests/cluster/README.md)
#   make cluster-up       start the "dev" plane (PLANE=name to pick another) and print export KUBECONFIG=...
#   make cluster-down     stop it;  make cluster-status: is it healthy?
#   make cluster-test     the tests that prove the plane is real (pytest -m cluster tests/cluster)
PLANE ?= dev
PLANE_PY := $(shell test -x $(VPY) && echo $(VPY) || echo python3)

.PHONY: cluster-build cluster-up cluster-down cluster-status cluster-env cluster-test
cluster-build:
	bash tests/cluster/build.sh

cluster-up: cluster-build
	$(PLANE_PY) tests/cluster/plane.py up --name $(PLANE)

cluster-down:
	$(PLANE_PY) tests/cluster/plane.py down --name $(PLANE)

cluster-status:
	$(PLANE_PY) tests/cluster/plane.py status --name $(PLANE)

cluster-env:
	@$(PLANE_PY) tests/cluster/plane.py env --name $(PLANE)

cluster-test: cluster-build
	$(VPY) -m pytest -q -m cluster tests/cluster
