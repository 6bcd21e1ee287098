{{/* Names and labels, as in the prometheus-community charts. */}}

{{- define "kvtier.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvtier.fullname" -}}
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

{{- define "kvtier.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object; "component" is the caller's. */}}
{{- define "kvtier.labels" -}}
helm.sh/chart: {{ include "kvtier.chart" .root }}
{{ include "kvtier.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{- define "kvtier.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvtier.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- /* The operator's image (docker/Dockerfile.operator). */}}
{{- define "kvtier.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{- /* The cache tier's image (docker/Dockerfile.server): the default tier, CacheTiers without spec.image, helm test. */}}
{{- define "kvtier.tierImage" -}}
{{- printf "%s:%s" .Values.tierImage.repository (.Values.tierImage.tag | default .Chart.AppVersion) }}
{{- end }}

{{- define "kvtier.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (printf "%s-operator" (include "kvtier.fullname" .)) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvtier.redisName" -}}
{{- printf "%s-redis" (include "kvtier.fullname" .) }}
{{- end }}

{{/* The Secret (name, key) with the Redis password; name is empty when Redis has none. */}}
{{- define "kvtier.redisPasswordSecretName" -}}
{{- if .Values.redis.passwordSecret.name }}
{{- .Values.redis.passwordSecret.name }}
{{- else if eq .Values.redis.mode "inChart" }}
{{- include "kvtier.redisName" . }}
{{- end }}
{{- end }}

{{- define "kvtier.redisUrl" -}}
{{- if eq .Values.redis.mode "inChart" }}
{{- printf "redis://%s.%s.svc:6379/0" (include "kvtier.redisName" .) .Release.Namespace }}
{{- else if eq .Values.redis.mode "external" }}
{{- required "redis.url is required when redis.mode is external (redis://host:6379/0 or rediss://...)" .Values.redis.url }}
{{- end }}
{{- end }}

{{/*
The Pod Security "restricted" profile: every pod and container of the chart
uses these two blocks. The kvtier and Redis images run as non-root numeric users.
*/}}
{{- define "kvtier.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .uid }}
runAsGroup: {{ .uid }}
fsGroup: {{ .uid }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "kvtier.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end }}
