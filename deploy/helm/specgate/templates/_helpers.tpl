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

{{- define "specgate.secretName" -}}
{{- default (printf "%s-secret" (include "specgate.fullname" .)) .Values.existingSecret -}}
{{- end -}}

{{- define "specgate.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s-redis:6379/0" (include "specgate.fullname" .) -}}
{{- else -}}
{{- required "redis.externalUrl is required when redis.enabled is false" .Values.redis.externalUrl -}}
{{- end -}}
{{- end -}}

{{/* The SPECGATE_* environment every Ray pod gets: Serve replicas read their settings from it. */}}
{{- define "specgate.env" -}}
- name: SPECGATE_REDIS_URL
  value: {{ include "specgate.redisUrl" . | quote }}
- name: SPECGATE_MODEL
  value: {{ .Values.model | quote }}
- name: SPECGATE_ADMIN_KEY
  valueFrom:
    secretKeyRef: {name: {{ include "specgate.secretName" . }}, key: admin-key}
{{- if or .Values.tenants .Values.existingSecret }}
- name: SPECGATE_TENANTS_FILE
  value: /etc/specgate/tenants.yaml
{{- end }}
{{- range $k, $v := .Values.settings }}
- name: {{ printf "SPECGATE_%s" ($k | upper) }}
  value: {{ $v | quote }}
{{- end }}
{{- end -}}

{{/* Writable scratch for a read-only root filesystem: Ray's session files. The model is in the
image (deploy/Dockerfile fetches it at build time into SPECGATE_CACHE). */}}
{{- define "specgate.volumeMounts" -}}
- {name: tmp, mountPath: /tmp}
{{- if or .Values.tenants .Values.existingSecret }}
- {name: tenants, mountPath: /etc/specgate, readOnly: true}
{{- end }}
{{- end -}}

{{- define "specgate.volumes" -}}
- {name: tmp, emptyDir: {}}
{{- if or .Values.tenants .Values.existingSecret }}
- name: tenants
  secret:
    secretName: {{ include "specgate.secretName" . }}
    optional: true
    items: [{key: tenants.yaml, path: tenants.yaml}]
{{- end }}
{{- end -}}

{{/* One Ray pod template: $ = root context, .group = the group's values, .gpus = GPUs per pod. */}}
{{- define "specgate.rayPod" -}}
{{- $ := .root -}}
metadata:
  labels:
    {{- include "specgate.selectorLabels" $ | nindent 4 }}
    specgate.dev/ray-group: {{ .name }}
spec:
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
      image: {{ include "specgate.rayImage" $ }}
      imagePullPolicy: {{ $.Values.image.pullPolicy }}
      securityContext:
        {{- toYaml $.Values.securityContext | nindent 8 }}
      env:
        {{- include "specgate.env" $ | nindent 8 }}
      resources:
        requests:
          {{- toYaml .group.resources.requests | nindent 10 }}
        limits:
          {{- toYaml .group.resources.limits | nindent 10 }}
          {{- if .gpus }}
          nvidia.com/gpu: {{ .gpus }}
          {{- end }}
      {{- if eq .name "head" }}
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
        {{- include "specgate.volumeMounts" $ | nindent 8 }}
  volumes:
    {{- include "specgate.volumes" $ | nindent 4 }}
{{- end -}}
