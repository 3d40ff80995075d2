-- Argo CD health check for kiln.dev/InferenceEngine.
-- Install in argocd-cm:
--   resource.customizations.health.kiln.dev_InferenceEngine: |
--     <this file>
-- Healthy when the operator has observed the current generation and reports Ready;
-- Progressing while it builds the engine or rolls pods out; Degraded on a failed build,
-- an invalid spec or a missing cache claim; Suspended when spec.suspend is true.
local hs = {}
if obj.status == nil or obj.status.observedGeneration == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the Kiln operator"
  return hs
end
if obj.metadata.generation ~= nil and obj.status.observedGeneration < obj.metadata.generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. obj.metadata.generation
  return hs
end
local function cond(t)
  if obj.status.conditions == nil then return nil end
  for _, c in ipairs(obj.status.conditions) do
    if c.type == t then return c end
  end
  return nil
end
local degraded = cond("Degraded")
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = (degraded.reason or "Degraded") .. ": " .. (degraded.message or "")
  return hs
end
local phase = obj.status.phase
if phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = "spec.suspend is true"
  return hs
end
if phase == "Ready" then
  hs.status = "Healthy"
  hs.message = (obj.status.readyReplicas or 0) .. " ready replica(s), engine " .. (obj.status.engineHash or "")
  return hs
end
local progressing = cond("Progressing")
hs.status = "Progressing"
if progressing ~= nil and progressing.message ~= nil and progressing.message ~= "" then
  hs.message = progressing.message
else
  hs.message = phase or "Reconciling"
end
return hs
