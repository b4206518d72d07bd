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

{{/*
The preset server.preset names, from files/presets.yaml (generated from
warmup_agent/server/kinds.py), as YAML; {} for custom.
*/}}
{{- define "warmup-agent.preset" -}}
{{- $name := default "vllm" .Values.server.preset }}
{{- $presets := fromYaml (.Files.Get "files/presets.yaml") }}
{{- if eq $name "custom" }}
{{- toYaml (dict) }}
{{- else if hasKey $presets $name }}
{{- toYaml (index $presets $name) }}
{{- else }}
{{- fail (printf "server.preset %s is not one of %s, custom" $name (keys $presets | sortAlpha | join ", ")) }}
{{- end }}
{{- end }}

{{/*
The model server's command line, built from server.preset, as JSON:
  {"command": [...], "args": [...]}.
A preset puts its executable (server.command, else the preset's own) and every argument
in "command": its model flag and server.model, its host flag with 0.0.0.0 (127.0.0.1 in
entrypoint mode with proxy.enabled: then only the agent's proxy reaches it), its port flag
with server.port, its served-model-name flag with server.servedModelName, then
server.extraArgs. custom takes server.command verbatim, and server.args then
server.extraArgs as "args". Entrypoint mode runs command and args after the agent's `--`;
sidecar mode gives them to the server container.
*/}}
{{- define "warmup-agent.serverCommand" -}}
{{- $s := .Values.server }}
{{- $preset := default "vllm" $s.preset }}
{{- $p := fromYaml (include "warmup-agent.preset" .) }}
{{- $name := $s.servedModelName }}
{{- $exe := default (list) $s.command }}
{{- $cmd := list }}
{{- $args := list }}
{{- $extra := default (list) $s.extraArgs }}
{{- if eq $preset "custom" }}
{{- if not $exe }}
{{- fail "server.command is empty: server.preset custom needs the server's command (a list, e.g. [my-server]) and its arguments in server.args" }}
{{- end }}
{{- $cmd = $exe }}
{{- $args = concat (default (list) $s.args) $extra }}
{{- else }}
{{- if $s.args }}
{{- fail (printf "server.args is for server.preset custom only (server.preset is %s, which builds its own arguments): put more arguments in server.extraArgs" $preset) }}
{{- end }}
{{- if and $name (not $p.servedNameFlag) }}
{{- fail (printf "server.servedModelName must be empty with server.preset %s: `%s` has no served-model-name flag and serves the model under server.model" $preset $p.label) }}
{{- end }}
{{- $cmd = default $p.executable $exe }}
{{- if $p.modelFlag }}{{ $cmd = append $cmd $p.modelFlag }}{{ end }}
{{- $host := and .Values.proxy.enabled (eq .Values.mode "entrypoint") | ternary "127.0.0.1" "0.0.0.0" }}
{{- $cmd = concat $cmd (list $s.model $p.hostFlag $host $p.portFlag (toString $s.port)) }}
{{- if $name }}{{ $cmd = concat $cmd (list $p.servedNameFlag $name) }}{{ end }}
{{- $cmd = concat $cmd $extra }}
{{- end }}
{{- toJson (dict "command" $cmd "args" $args) }}
{{- end }}

{{/* Health path of the model server: server.healthPath, else the preset's. */}}
{{- define "warmup-agent.healthPath" -}}
{{- $p := fromYaml (include "warmup-agent.preset" .) }}
{{- default (default "/health" $p.healthPath) .Values.server.healthPath }}
{{- end }}

{{/* The server container's image (sidecar mode): server.image, else the preset's default image. */}}
{{- define "warmup-agent.serverImage" -}}
{{- $i := .Values.server.image }}
{{- $preset := default "vllm" .Values.server.preset }}
{{- $p := fromYaml (include "warmup-agent.preset" .) }}
{{- if $i.repository }}
{{- if not $i.tag }}
{{- fail (printf "server.image.tag is empty: give the tag of %s (only a preset's default image has one)" $i.repository) }}
{{- end }}
{{- printf "%s:%s" $i.repository (toString $i.tag) }}
{{- else if $p.image }}
{{- printf "%s:%s" $p.image (toString (default $p.imageTag $i.tag)) }}
{{- else }}
{{- fail (printf "server.image.repository is empty: mode sidecar with server.preset %s needs the image of that server in server.image.repository and server.image.tag (this preset has no default image)" $preset) }}
{{- end }}
{{- end }}

{{/* Paths inside the pod. */}}
{{- define "warmup-agent.configPath" -}}/etc/warmup-agent/config.yaml{{- end }}
{{- define "warmup-agent.hmacKeyPath" -}}/etc/warmup-agent/secrets/hmac-key{{- end }}

{{/*
The agent's configuration file, in three layers:
  defaults  from other values, which agent.config may override (timeouts, served model);
  agent.config;
  derived   keys the probes, Service and volumes are built from; these win, so each has
            one place (engine, exporter.listen, data_dir, openai.url, openai.health_path,
            kernel_cache, proxy.listen).
*/}}
{{- define "warmup-agent.config" -}}
{{- $load := .Values.server.loadTimeoutSeconds }}
{{- $defaults := dict
    "openai" (dict "ready_timeout_seconds" $load)
    "deadlines" (dict "preload_seconds" $load) }}
{{- $p := fromYaml (include "warmup-agent.preset" .) }}
{{- if .Values.server.servedModelName }}
{{- $_ := set $defaults.openai "model" .Values.server.servedModelName }}
{{- else if and (hasKey $p "servedNameFlag") (not $p.servedNameFlag) }}
{{- /* a server without a served-model-name flag serves the model under its path or id */}}
{{- $_ := set $defaults.openai "model" .Values.server.model }}
{{- end }}
{{- if and (eq .Values.mode "entrypoint") $p.givesModelPath (hasPrefix "/" .Values.server.model) }}
{{- /* the agent finds the tokenizer in the model directory */}}
{{- $_ := set $defaults "model" (dict "path" .Values.server.model) }}
{{- end }}
{{- $derived := dict
    "engine" "openai"
    "data_dir" .Values.cache.mountPath
    "exporter" (dict "listen" (printf "0.0.0.0:%d" (int .Values.agent.port)))
    "openai" (dict "url" (printf "http://127.0.0.1:%d" (int .Values.server.port))
                   "health_path" (include "warmup-agent.healthPath" .)) }}
{{- if .Values.kernelCache.enabled }}
{{- $_ := set $derived "kernel_cache" (dict "redis_url" (include "warmup-agent.redisUrl" .) "secret_file" (include "warmup-agent.hmacKeyPath" .)) }}
{{- end }}
{{- if hasKey (default (dict) (get (default (dict) .Values.agent.config) "proxy")) "listen" }}
{{- fail "agent.config.proxy.listen is the chart's: set proxy.enabled and proxy.port instead (the Service's http port must target the proxy's port)" }}
{{- end }}
{{- if .Values.proxy.enabled }}
{{- $_ := set $derived "proxy" (dict "listen" (printf "0.0.0.0:%d" (int .Values.proxy.port))) }}
{{- end }}
{{- if .Values.tracing.enabled }}
{{- $_ := set $derived "tracing" (dict "enabled" true "endpoint" .Values.tracing.endpoint "protocol" .Values.tracing.protocol) }}
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
