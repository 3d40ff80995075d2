"""The Kiln operator: reconciles ``InferenceEngine`` resources (group ``kiln.dev``) into an
engine cache claim, a build Job, a serving Deployment, a Service and an autoscaler.

Torch-free: shares ``kiln.common`` with the runtime, never imports ``kiln.runtime``.  Entry point:
``kiln.operator.main:run(argv) -> int`` (``kiln operator ...``).  Modules: ``constants``
(names, labels), ``spec`` (the typed ``InferenceEngineSpec``), ``builders`` (pure manifest
functions), ``plan`` (the pure planner: observed state in, children and status out), ``kube``
(the API client and the one server-side-apply helper), ``conditions``, ``reconcile`` (one
reconcile: parse, observe, plan, act), ``autoscaler`` (builtin queue-time autoscaler),
``leader`` (Lease election), ``controller`` (work queue, resync, autoscaler loop), ``main``
(kopf handlers and the CLI).
"""
