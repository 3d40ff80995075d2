# The development Kubernetes control plane (devcluster/): binaries built from source through the
# Go module proxy and cached under ~/.cache/kiln/cluster/<versions>/, run as plain processes.
#   make cluster-build    build or reuse the cached binaries (first time: see devcluster/README.md)
#   make cluster-up       start the "dev" plane (PLANE=name to pick another) and print export KUBECONFIG=...
#   make cluster-down     stop it;  make cluster-status: is it healthy?
#   make cluster-test     the tests that prove the plane is real (pytest -m cluster tests/cluster)
#   make metrics-build    build or reuse prometheus-adapter (the HPA end-to-end test's custom metrics server)
PLANE ?= dev
# kiln.devcluster.plane is stdlib only: without the venv any python3 runs it from devcluster/.
PLANE_PY := $(shell test -x $(VPY) && echo $(VPY) || echo PYTHONPATH=devcluster python3)

.PHONY: metrics-build cluster-build cluster-up cluster-down cluster-status cluster-env cluster-test
cluster-build:
	bash devcluster/build.sh

metrics-build:
	bash devcluster/build.sh prometheus-adapter

cluster-up: cluster-build
	$(PLANE_PY) -m kiln.devcluster.plane up --name $(PLANE)

cluster-down:
	$(PLANE_PY) -m kiln.devcluster.plane down --name $(PLANE)

cluster-status:
	$(PLANE_PY) -m kiln.devcluster.plane status --name $(PLANE)

cluster-env:
	@$(PLANE_PY) -m kiln.devcluster.plane env --name $(PLANE)

cluster-test: cluster-build
	$(VPY) -m pytest -q -m cluster tests/cluster
