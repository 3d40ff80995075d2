"""Plugins of the whole suite: the control-plane fixtures (`kube_plane`, `namespace`) and the
interrupt handling that stops every plane, operator, pod process and build a run started."""

pytest_plugins = ["kiln.devcluster.fixtures"]
