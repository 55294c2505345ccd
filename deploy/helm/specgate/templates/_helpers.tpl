{{- define "specgate.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "specgate.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "specgate.labels" -}}
app.kubernetes.io/name: {{ include "specgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "specgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "specgate.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "specgate.rayImage" -}}
{{- default (include "specgate.image" .) .Values.ray.image -}}
{{- end -}}

{{- define "specgate.gpuImage" -}}
{{- default (printf "%s-cuda" (include "specgate.rayImage" .)) .Values.ray.gpuWorkers.image -}}
{{- end -}}

{{- define "specgate.secretName" -}}
{{- default (printf "%s-secret" (include "specgate.fullname" .)) .Values.existingSecret -}}
{{- end -}}

{{/* A secret value the chart generates when the values give none, kept across upgrades: the value
already in the release's live Secret when there is one (`lookup`; empty under `helm template`, where
each render generates anew). .root, .secret (the Secret's name), .key, .given (the values' one). */}}
{{- define "specgate.keptSecret" -}}
{{- if .given -}}
{{- .given -}}
{{- else -}}
{{- $live := lookup "v1" "Secret" .root.Release.Namespace .secret -}}
{{- $kept := dig "data" .key "" $live -}}
{{- if $kept -}}
{{- $kept | b64dec -}}
{{- else -}}
{{- randAlphaNum 40 -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "specgate.metricsSecretName" -}}
{{- printf "%s-metrics" (include "specgate.fullname" .) -}}
{{- end -}}

{{/* Where the key pepper lives: an existing Secret (keyPepperSecret), or the one this chart makes
(secret-pepper.yaml). Its name, then its key. */}}
{{- define "specgate.pepperSecretName" -}}
{{- default (printf "%s-key-pepper" (include "specgate.fullname" .)) .Values.keyPepperSecret.name -}}
{{- end -}}

{{- define "specgate.pepperSecretKey" -}}
{{- if .Values.keyPepperSecret.name -}}
{{- .Values.keyPepperSecret.key | default "key-pepper" -}}
{{- else -}}
key-pepper
{{- end -}}
{{- end -}}

{{/* Where the Redis URL (with its password) lives: an existing Secret (external Redis), or the one
this chart makes (secret-redis.yaml). Its name, then its key. */}}
{{- define "specgate.redisUrlSecretName" -}}
{{- if and (not .Values.redis.enabled) .Values.redis.externalUrlSecret.name -}}
{{- .Values.redis.externalUrlSecret.name -}}
{{- else -}}
{{- printf "%s-redis" (include "specgate.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "specgate.redisUrlSecretKey" -}}
{{- if and (not .Values.redis.enabled) .Values.redis.externalUrlSecret.name -}}
{{- .Values.redis.externalUrlSecret.key | default "redis-url" -}}
{{- else -}}
redis-url
{{- end -}}
{{- end -}}

{{/* The gateway's pods: the CPU workers, where the ingress and scheduler replicas run (the head,
num-cpus 0, runs Ray's control plane, Serve's proxies and the app builder, none of which needs a
secret). The only pods with the keys and the Redis URL, and the only ones the Redis
NetworkPolicy admits. */}}
{{- define "specgate.gatewayLabel" -}}
specgate.dev/gateway: "true"
{{- end -}}

{{/* The KubeRay operator as a NetworkPolicy peer: its pods in its own namespace, never any
namespace's pods with the operator's label (anyone can label a pod). */}}
{{- define "specgate.operatorPeer" -}}
{{- $peer := .Values.networkPolicy.kuberayOperator -}}
{{- $ns := or (dig "namespaceSelector" "matchLabels" (dict) $peer) (dig "namespaceSelector" "matchExpressions" (list) $peer) -}}
{{- $pods := or (dig "podSelector" "matchLabels" (dict) $peer) (dig "podSelector" "matchExpressions" (list) $peer) -}}
{{- if not (and $ns $pods) -}}
{{- fail "networkPolicy.kuberayOperator needs a namespaceSelector and a podSelector that each select something: the operator's own namespace, and its pods there" -}}
{{- end -}}
{{- toYaml $peer -}}
{{- end -}}

{{/* Every Ray pod of this release (head and workers), for the NetworkPolicies. */}}
{{- define "specgate.rayPodLabels" -}}
{{ include "specgate.selectorLabels" . }}
app.kubernetes.io/component: ray
{{- end -}}

{{/* The SPECGATE_* environment of every Ray pod: Serve replicas read their settings from it. Secrets
(the keys, the key pepper, the Redis URL) only in the gateway's pods (.gateway), and only through
secretKeyRef.
NOTE: no secret ever passes through Ray: gateway.builders.ray_app builds the app from the Serve
config and the non-secret settings of the environment where Serve runs the builder, and each
replica reads the secrets it needs from its own pod's environment (ingress: all; scheduler: the
Redis URL; verifiers and draft workers: none, even on a CPU worker;
gateway/ray_serve/replica_secrets.py). Serve keeps deployments' arguments where every Ray pod can
read them; a GPU pod has no secret to read anywhere. */}}
{{- define "specgate.env" -}}
{{- $ := .root -}}
- name: SPECGATE_MODEL
  value: {{ $.Values.model | quote }}
{{- range $k, $v := $.Values.settings }}
- name: {{ printf "SPECGATE_%s" ($k | upper) }}
  value: {{ $v | quote }}
{{- end }}
{{- /* Serve's gRPC proxy (on every Ray node) caps a message only by this variable; one cap for a
REST body and a gRPC message: settings.max_body_bytes, else the gateway's default (2 MiB). */}}
- name: RAY_SERVE_GRPC_MAX_MESSAGE_SIZE
  value: {{ $.Values.settings.max_body_bytes | default 2097152 | int | quote }}
{{- if .gateway }}
- name: SPECGATE_REDIS_URL
  valueFrom:
    secretKeyRef: {name: {{ include "specgate.redisUrlSecretName" $ }}, key: {{ include "specgate.redisUrlSecretKey" $ }}}
- name: SPECGATE_ADMIN_KEY
  valueFrom:
    secretKeyRef: {name: {{ include "specgate.secretName" $ }}, key: admin-key}
- name: SPECGATE_METRICS_KEY
  valueFrom:
    secretKeyRef: {name: {{ include "specgate.metricsSecretName" $ }}, key: metrics-key}
- name: SPECGATE_KEY_PEPPER
  valueFrom:
    secretKeyRef: {name: {{ include "specgate.pepperSecretName" $ }}, key: {{ include "specgate.pepperSecretKey" $ }}}
{{- if or $.Values.tenants $.Values.existingSecret }}
- name: SPECGATE_TENANTS_FILE
  value: /etc/specgate/tenants.yaml
{{- end }}
{{- end }}
{{- end -}}

{{/* Writable scratch for a read-only root filesystem: Ray's session files (HOME is /tmp in the
image). The model is in the image (deploy/Dockerfile fetches it at build time into SPECGATE_CACHE). */}}
{{- define "specgate.volumeMounts" -}}
- {name: tmp, mountPath: /tmp}
{{- if and .gateway (or .root.Values.tenants .root.Values.existingSecret) }}
- {name: tenants, mountPath: /etc/specgate, readOnly: true}
{{- end }}
{{- end -}}

{{- define "specgate.volumes" -}}
- {name: tmp, emptyDir: {}}
{{- if and .gateway (or .root.Values.tenants .root.Values.existingSecret) }}
- name: tenants
  secret:
    secretName: {{ include "specgate.secretName" .root }}
    optional: true
    items: [{key: tenants.yaml, path: tenants.yaml}]
{{- end }}
{{- end -}}

{{/* One Ray pod template: $ = root context, .group = the group's values, .gpus = GPUs per pod,
.gateway = whether the pod serves requests (keys, Redis URL, tenants file). */}}
{{- define "specgate.rayPod" -}}
{{- $ := .root -}}
metadata:
  labels:
    {{- include "specgate.rayPodLabels" $ | nindent 4 }}
    specgate.dev/ray-group: {{ .name }}
    {{- if .gateway }}
    {{- include "specgate.gatewayLabel" $ | nindent 4 }}
    {{- end }}
spec:
  {{- if ne .name "head" }}
  # Workers never call the Kubernetes API. (The head keeps its token: KubeRay's autoscaler sidecar
  # scales the cluster through it.)
  automountServiceAccountToken: false
  {{- end }}
  securityContext:
    {{- toYaml $.Values.podSecurityContext | nindent 4 }}
  {{- with $.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .group.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .group.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: ray-{{ .name }}
      image: {{ if .gpus }}{{ include "specgate.gpuImage" $ }}{{ else }}{{ include "specgate.rayImage" $ }}{{ end }}
      imagePullPolicy: {{ $.Values.image.pullPolicy }}
      securityContext:
        {{- toYaml $.Values.securityContext | nindent 8 }}
      env:
        {{- include "specgate.env" . | nindent 8 }}
        {{- if .gpus }}
        # the verifier replicas Ray places here run on their GPU (gateway/ray_serve/deployments.py)
        - name: SPECGATE_DEVICE
          value: cuda
        {{- end }}
      resources:
        requests:
          {{- toYaml .group.resources.requests | nindent 10 }}
        limits:
          {{- toYaml .group.resources.limits | nindent 10 }}
          {{- if .gpus }}
          nvidia.com/gpu: {{ .gpus }}
          {{- end }}
      {{- if eq .name "head" }}
      # KubeRay's head Service (not this chart's) carries these: the operator reaches the dashboard
      # there. The NetworkPolicies decide who else may.
      ports:
        - {name: gcs, containerPort: 6379}
        - {name: dashboard, containerPort: 8265}
        - {name: http, containerPort: 8000}
      readinessProbe:
        httpGet: {path: /ready, port: http}
        periodSeconds: 10
        failureThreshold: 3
      livenessProbe:
        httpGet: {path: /health, port: http}
        initialDelaySeconds: 120
        periodSeconds: 20
        failureThreshold: 6
      {{- end }}
      volumeMounts:
        {{- include "specgate.volumeMounts" . | nindent 8 }}
  volumes:
    {{- include "specgate.volumes" . | nindent 4 }}
{{- end -}}

{{/* redis.maxmemory, checked against the container's memory limit when both are in the usual units
(Redis's "mb" is 2^20 bytes, like Kubernetes' "Mi"): at or past the limit, Redis is killed for
memory before it ever refuses a write. */}}
{{- define "specgate.redisMaxmemory" -}}
{{- $max := .Values.redis.maxmemory -}}
{{- $limit := toString (dig "limits" "memory" "" .Values.redis.resources) -}}
{{- if and (regexMatch "^[0-9]+mb$" $max) (regexMatch "^[0-9]+(Mi|Gi)$" $limit) -}}
{{- $maxMi := trimSuffix "mb" $max | atoi -}}
{{- $limitMi := ternary (mul (trimSuffix "Gi" $limit | atoi) 1024) (trimSuffix "Mi" $limit | atoi) (hasSuffix "Gi" $limit) -}}
{{- if ge $maxMi $limitMi -}}
{{- fail (printf "redis.maxmemory (%s) must be below redis.resources.limits.memory (%s)" $max $limit) -}}
{{- end -}}
{{- end -}}
{{- $max -}}
{{- end -}}
