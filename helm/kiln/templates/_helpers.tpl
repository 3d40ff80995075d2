{{/* Full name of the release's objects. */}}
{{- define "kiln.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kiln.labels" -}}
app.kubernetes.io/name: kiln
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kiln
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kiln.selectorLabels" -}}
app.kubernetes.io/name: kiln
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kiln.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kiln.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Namespaces watched (and granted Roles in) unless cluster scope is unrestricted. */}}
{{- define "kiln.watchNamespaces" -}}
{{- if .Values.watchNamespaces -}}
{{- join "," .Values.watchNamespaces -}}
{{- else -}}
{{- .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{/* Rules the operator needs on InferenceEngines and their children (least privilege). */}}
{{- define "kiln.rules" -}}
- apiGroups: [kiln.dev]
  resources: [inferenceengines]
  verbs: [get, list, watch]
- apiGroups: [kiln.dev]
  resources: [inferenceengines/status]
  verbs: [get, patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [services, configmaps, persistentvolumeclaims]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [list, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [secrets, pods/log]
  verbs: [get]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
# --- spec.gateway and autoscaling mode keda (optional APIs, used where discovery finds them) ---
- apiGroups: [gateway.networking.k8s.io]
  resources: [httproutes]
  verbs: [get, create, patch, delete]
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, create, patch, delete]
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [get, create, patch, delete]
# the endpoint picker's objects (owned by its InferencePool: deleted with it, never by the operator)
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, create, patch]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [rolebindings]
  verbs: [get, create, patch]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [clusterroles, roles]
  verbs: [bind]
  resourceNames:
    - '{{ include "kiln.fullname" . }}-endpoint-picker'
# --- end spec.gateway and mode keda ---
{{- end -}}

{{/* --- router --- */}}
{{- define "kiln.routerSelectorLabels" -}}
app.kubernetes.io/name: kiln
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: router
{{- end -}}

{{/* Rules of the router: read engines and their endpoints, patch engines (the activity annotation). */}}
{{- define "kiln.routerRules" -}}
- apiGroups: [kiln.dev]
  resources: [inferenceengines]
  verbs: [list, watch, patch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
{{- end -}}
{{/* --- end router --- */}}
