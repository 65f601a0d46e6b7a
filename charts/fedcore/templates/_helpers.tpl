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

{{/* "true" when the operator reconciles FederatedRuns (mode hub or both), else "". */}}
{{- define "fedcore.hub" -}}
{{- if ne .Values.mode "site" }}true{{ end -}}
{{- end -}}

{{/* "true" when the operator reconciles Participations (mode site or both, and site.hub set),
else "". Fails when mode site lacks site.hub, or site reconciling lacks site.fingerprint. */}}
{{- define "fedcore.site" -}}
{{- if and (eq .Values.mode "site") (not .Values.site.hub) -}}
{{- fail "mode: site needs site.hub (the hub endpoint's host:port) and site.fingerprint (the hub CA's sha256:... fingerprint, given with the join token)" -}}
{{- end -}}
{{- if and (ne .Values.mode "hub") .Values.site.hub -}}
{{- if not .Values.site.fingerprint -}}
{{- fail "site.hub is set: site.fingerprint is required too (the hub CA's sha256:... fingerprint, given with the join token)" -}}
{{- end -}}
true
{{- end -}}
{{- end -}}

{{/* "true" when the FederatedRun validating webhook is served (webhook.enabled, mode not site). */}}
{{- define "fedcore.webhook" -}}
{{- if and .Values.webhook.enabled (or (include "fedcore.hub" .) (include "fedcore.site" .)) }}true{{ end -}}
{{- end -}}

{{/* The operator's own image: the runtime image when it reconciles Participations (the site
review computes the run's planned epsilon: torch, dp-accounting), else the operator image. */}}
{{- define "fedcore.operatorContainerImage" -}}
{{- if include "fedcore.site" . -}}
{{- include "fedcore.runtimeImage" . -}}
{{- else -}}
{{- include "fedcore.operatorImage" . -}}
{{- end -}}
{{- end -}}

{{/* The port of site.hub (host:port). */}}
{{- define "fedcore.hubPort" -}}
{{- splitList ":" .Values.site.hub | last -}}
{{- end -}}
