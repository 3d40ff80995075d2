-- Argo CD health check for kiln.dev/InferenceEngine.
-- Install in argocd-cm:
--   resource.customizations.health.kiln.dev_InferenceEngine: |
--     <this file>
-- Healthy when the operator has observed the current generation and reports Ready;
-- Progressing while it builds the engine or rolls pods out; Degraded whenever the operator
-- says so (a failed build, crash-looping or unschedulable pods, a child the API server
-- refused, an invalid spec, a missing cache claim); Suspended when spec.suspend is true or
-- the resource is scaled to zero (replicas: 0, or an autoscaler at zero) and settled.
-- Fields of unexpected types never raise: numbers are read with tonumber.
local hs = {}
local status = obj.status
if type(status) ~= "table" or tonumber(status.observedGeneration) == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the Kiln operator"
  return hs
end
local generation = tonumber(obj.metadata and obj.metadata.generation)
if generation ~= nil and tonumber(status.observedGeneration) < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. obj.metadata.generation
  return hs
end
local function cond(t)
  if type(status.conditions) ~= "table" then return nil end
  for _, c in ipairs(status.conditions) do
    if type(c) == "table" and c.type == t then return c end
  end
  return nil
end
local degraded = cond("Degraded")
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = tostring(degraded.reason or "Degraded") .. ": " .. tostring(degraded.message or "")
  return hs
end
local phase = status.phase
if phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = "spec.suspend is true"
  return hs
end
if phase == "Ready" then
  hs.status = "Healthy"
  hs.message = tostring(tonumber(status.readyReplicas) or 0) .. " ready replica(s), engine " .. tostring(status.engineHash or "")
  return hs
end
local progressing = cond("Progressing")
local spec = type(obj.spec) == "table" and obj.spec or {}
local scaled_to_zero = tonumber(spec.replicas) == 0 or (tonumber(status.replicas) or 0) == 0
if scaled_to_zero and progressing ~= nil and progressing.status == "False" and cond("EngineBuilt") ~= nil
    and cond("EngineBuilt").status == "True" then
  hs.status = "Suspended"
  hs.message = "scaled to zero"
  return hs
end
hs.status = "Progressing"
if progressing ~= nil and type(progressing.message) == "string" and progressing.message ~= "" then
  hs.message = progressing.message
else
  hs.message = tostring(phase or "Reconciling")
end
return hs
