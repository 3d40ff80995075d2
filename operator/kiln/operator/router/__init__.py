"""The Kiln router (``kiln router``): one OpenAI / KServe v2 endpoint in front of every
InferenceEngine it may see.  Modules: ``config`` (flags), ``table`` (engines, models, ready
replicas), ``discovery`` (list + watch of InferenceEngines and EndpointSlices), ``balance``
(prefix affinity with bounded loads, least outstanding, round robin), ``proxy`` (hold queue and
streaming forwarder), ``activity`` (the scale-to-zero signal), ``metrics``, ``app``.
Torch-free, like the rest of ``kiln.operator``."""
