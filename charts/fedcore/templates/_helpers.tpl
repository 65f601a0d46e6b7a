{{/* The name of everything this release installs. */}}
{{- define "fedcore.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "fedcore.labels" -}}
app.kubernetes.io/name: fedcore
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "fedcore.selectorLabels" -}}
app.kubernetes.io/name: fedcore
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "fedcore.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) -}}
{{- end -}}

{{- define "fedcore.runtimeImage" -}}
{{- printf "%s:%s" .Values.runtime.image.repository (default .Chart.AppVersion .Values.runtime.image.tag) -}}
{{- end -}}

{{- define "fedcore.webhookSecret" -}}
{{- default (printf "%s-webhook-tls" (include "fedcore.fullname" .)) .Values.webhook.existingSecret -}}
{{- end -}}

{{/* The namespaces the operator reconciles and holds RBAC in (JSON list): the release
namespace and operator.watchNamespaces; none with operator.clusterWide (all of them). */}}
{{- define "fedcore.namespaces" -}}
{{- if .Values.operator.clusterWide -}}
[]
{{- else -}}
{{- uniq (prepend .Values.operator.watchNamespaces .Release.Namespace) | toJson -}}
{{- end -}}
{{- end -}}
