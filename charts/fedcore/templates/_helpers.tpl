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

{{/* "true" when the operator serves the hub's endpoint (hub.enabled, mode hub or both), else "".
Fails on hub.enabled in mode site or with more than one replica, on a hub.port taken by another of the operator's ports, and
on hub.service values that its type does not take. */}}
{{- define "fedcore.hubEndpoint" -}}
{{- $hub := .Values.hub -}}
{{- if $hub.enabled -}}
{{- if eq .Values.mode "site" -}}
{{- fail "hub.enabled is true in mode: site: a site does not serve the hub's endpoint (set mode: hub or both, or hub.enabled: false)" -}}
{{- end -}}
{{- if gt (int .Values.operator.replicas) 1 -}}
{{- fail "hub.enabled needs operator.replicas: 1 (only the leader serves the hub's endpoint, and its Service would send sites to the standby replicas too)" -}}
{{- end -}}
{{- if has (int $hub.port) (list (int .Values.metrics.port) (int .Values.webhook.port) 8081) -}}
{{- fail (printf "hub.port %d is taken by another port of the operator (metrics.port, webhook.port or 8081, its health port)" (int $hub.port)) -}}
{{- end -}}
{{- $type := $hub.service.type -}}
{{- if and (eq $type "ClusterIP") (or (not (kindIs "invalid" $hub.service.nodePort)) $hub.service.externalTrafficPolicy) -}}
{{- fail "hub.service.nodePort and hub.service.externalTrafficPolicy need hub.service.type NodePort or LoadBalancer" -}}
{{- end -}}
{{- if and (ne $type "LoadBalancer") (or $hub.service.loadBalancerIP $hub.service.loadBalancerSourceRanges) -}}
{{- fail "hub.service.loadBalancerIP and hub.service.loadBalancerSourceRanges need hub.service.type LoadBalancer" -}}
{{- end -}}
{{- if and $hub.ingress.enabled (not $hub.ingress.host) -}}
{{- fail "hub.ingress.enabled needs hub.ingress.host (the host name the sites dial, which the ingress controller matches by SNI)" -}}
{{- end -}}
true
{{- end -}}
{{- end -}}

{{/* The TLS server names (SNI) of the hub endpoint's roles that an Ingress routes (JSON list). */}}
{{- define "fedcore.hubServerNames" -}}
{{- list "hub.fedcore.invalid" "server.fedcore.invalid" "kdc.fedcore.invalid" | toJson -}}
{{- end -}}
