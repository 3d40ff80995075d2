"""The development cluster: a real Kubernetes control plane run as local processes (plane), a
process-backed node that runs pods as local processes (procnode, proc_pod), a one-Service proxy
(proc_proxy), the whole Kiln stack on them (stack) for the demo (demo) and the end-to-end tests,
their pytest plugin (fixtures), and the process and wait helpers they share (procs, wait).

Development infrastructure, not product code: nothing in kiln.runtime, kiln.operator,
kiln.kernels or kiln.common imports it. See devcluster/README.md.
"""
