{{/* Chart name, truncated to the 63 characters a label value may hold. */}}
{{- define "warmup-agent.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name: release-chart, or the release name when it already holds the chart name. */}}
{{- define "warmup-agent.fullname" -}}
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

{{- define "warmup-agent.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every resource, without the component. */}}
{{- define "warmup-agent.commonLabels" -}}
helm.sh/chart: {{ include "warmup-agent.chart" . }}
app.kubernetes.io/name: {{ include "warmup-agent.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels of the model-server resources. */}}
{{- define "warmup-agent.labels" -}}
{{ include "warmup-agent.commonLabels" . }}
app.kubernetes.io/component: model-server
{{- end }}

{{/* Selects the model-server pods (not the development Redis). */}}
{{- define "warmup-agent.selectorLabels" -}}
app.kubernetes.io/name: {{ include "warmup-agent.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: model-server
{{- end }}

{{- define "warmup-agent.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "warmup-agent.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Secret holding the kernel-cache HMAC key: the user's, or the one this chart creates. */}}
{{- define "warmup-agent.hmacSecretName" -}}
{{- default (printf "%s-kernel-cache-hmac" (include "warmup-agent.fullname" .)) .Values.kernelCache.hmacSecret.existingSecret }}
{{- end }}

{{- define "warmup-agent.redisName" -}}
{{- printf "%s-redis" (include "warmup-agent.fullname" . | trunc 57 | trimSuffix "-") }}
{{- end }}

{{/* Redis URL of the kernel cache: the configured one, else the development Redis. */}}
{{- define "warmup-agent.redisUrl" -}}
{{- if .Values.kernelCache.redisUrl }}
{{- .Values.kernelCache.redisUrl }}
{{- else if .Values.redis.enabled }}
{{- printf "redis://%s:6379/0" (include "warmup-agent.redisName" .) }}
{{- else }}
{{- fail "kernelCache.enabled is true but kernelCache.redisUrl is empty: set it to the URL of an existing Redis (redis://HOST:6379/0), or set redis.enabled=true for a development Redis" }}
{{- end }}
{{- end }}

{{- define "warmup-agent.image" -}}
{{- printf "%s:%s" .repository (toString .tag) }}
{{- end }}

{{/* Paths inside the pod. */}}
{{- define "warmup-agent.configPath" -}}/etc/warmup-agent/config.yaml{{- end }}
{{- define "warmup-agent.hmacKeyPath" -}}/etc/warmup-agent/secrets/hmac-key{{- end }}

{{/*
The agent's configuration file, in three layers:
  defaults  from other values, which agent.config may override (timeouts, served model);
  agent.config;
  derived   keys the probes, Service and volumes are built from; these win, so each has
            one place (engine, exporter.listen, data_dir, openai.url, kernel_cache).
*/}}
{{- define "warmup-agent.config" -}}
{{- $load := .Values.server.loadTimeoutSeconds }}
{{- $defaults := dict
    "openai" (dict "ready_timeout_seconds" $load)
    "deadlines" (dict "preload_seconds" $load) }}
{{- if .Values.server.servedModelName }}
{{- $_ := set $defaults.openai "model" .Values.server.servedModelName }}
{{- end }}
{{- $derived := dict
    "engine" "openai"
    "data_dir" .Values.cache.mountPath
    "exporter" (dict "listen" (printf "0.0.0.0:%d" (int .Values.agent.port))) }}
{{- if eq .Values.mode "sidecar" }}
{{- $_ := set $derived "openai" (dict "url" (printf "http://127.0.0.1:%d" (int .Values.server.port))) }}
{{- end }}
{{- if .Values.kernelCache.enabled }}
{{- $_ := set $derived "kernel_cache" (dict "redis_url" (include "warmup-agent.redisUrl" .) "secret_file" (include "warmup-agent.hmacKeyPath" .)) }}
{{- end }}
{{- toYaml (mustMergeOverwrite $defaults (deepCopy .Values.agent.config) $derived) }}
{{- end }}

{{/*
Resources of a container.  With qos.guaranteed the requests are set equal to the
limits (the kubelet's static CPU manager gives exclusive CPUs only to Guaranteed pods
with whole-CPU requests, which is what stage 1's CPU pinning wants).
Call with (dict "resources" R "what" "server.resources" "guaranteed" BOOL).
*/}}
{{- define "warmup-agent.resources" -}}
{{- $r := deepCopy (default (dict) .resources) }}
{{- if .guaranteed }}
{{- $limits := default (dict) $r.limits }}
{{- if not (and (hasKey $limits "cpu") (hasKey $limits "memory")) }}
{{- fail (printf "qos.guaranteed is true but %s.limits lacks cpu or memory: a Guaranteed pod needs both in every container" .what) }}
{{- end }}
{{- if not (regexMatch "^[0-9]+$" (toString $limits.cpu)) }}
{{- fail (printf "qos.guaranteed is true but %s.limits.cpu is %v: exclusive CPUs need a whole number of CPUs, e.g. 4" .what $limits.cpu) }}
{{- end }}
{{- $_ := set $r "requests" (deepCopy $limits) }}
{{- end }}
{{- toYaml $r }}
{{- end }}

{{/* startupProbe failureThreshold: enough periods to cover server.loadTimeoutSeconds. */}}
{{- define "warmup-agent.startupFailureThreshold" -}}
{{- $p := int .Values.probes.startup.periodSeconds }}
{{- div (add (int .Values.server.loadTimeoutSeconds) (sub $p 1)) $p }}
{{- end }}

{{/*
Writable places for a read-only root filesystem: HOME and every cache that vLLM,
PyTorch, Triton and Hugging Face write go to the cache volume or /tmp.
*/}}
{{- define "warmup-agent.cacheEnv" -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: {{ .Values.cache.mountPath }}
- name: HF_HOME
  value: {{ .Values.cache.mountPath }}/huggingface
- name: VLLM_CACHE_ROOT
  value: {{ .Values.cache.mountPath }}/vllm
- name: TORCHINDUCTOR_CACHE_DIR
  value: {{ .Values.cache.mountPath }}/torchinductor
- name: TRITON_CACHE_DIR
  value: {{ .Values.cache.mountPath }}/triton
{{- end }}

{{/* Mounts of the container that runs the model server. */}}
{{- define "warmup-agent.serverMounts" -}}
- name: cache
  mountPath: {{ .Values.cache.mountPath }}
- name: tmp
  mountPath: /tmp
- name: shm
  mountPath: /dev/shm
{{- if .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end }}
