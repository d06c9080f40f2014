{{/* Names and labels shared by every template. */}}
{{- define "layerwise.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "layerwise.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The labels of an object that has no selector labels of its own. */}}
{{- define "layerwise.labels" -}}
{{ include "layerwise.metaLabels" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The labels beside a selector's (which carry the instance), so no key is written twice. */}}
{{- define "layerwise.metaLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/part-of: layerwise
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "layerwise.operatorSelector" -}}
app.kubernetes.io/name: {{ include "layerwise.name" . }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "layerwise.agentSelector" -}}
app.kubernetes.io/name: {{ include "layerwise.name" . }}-agent
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "layerwise.podSecurity" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "layerwise.containerSecurity" -}}
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end }}
