{{/* The namespace of every namespaced object: namespace.name, else the release's (`helm install -n NS`). */}}
{{- define "weightcache.namespace" -}}
{{- default .Release.Namespace .Values.namespace.name -}}
{{- end -}}

{{/* The weightcache image: repository@digest when a digest is given, else repository:tag, the tag defaulting to
     appVersion (the package version). */}}
{{- define "weightcache.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end }}
{{- end -}}

{{/* imagePullSecrets of a pod spec (nothing when none are set), at indent `.indent`. */}}
{{- define "weightcache.pullSecrets" -}}
{{- with .root.Values.imagePullSecrets }}
{{ printf "imagePullSecrets: %s" (toYaml . | nindent 2) | indent $.indent }}
{{- end }}
{{- end -}}

{{/* Labels of every object: deploy/'s two (name, component) and Helm's. Selectors use only deploy/'s two, so a
     kustomize install can be taken over by the chart without recreating its DaemonSet and Deployment. */}}
{{- define "weightcache.labels" -}}
app.kubernetes.io/name: weightcache
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{ include "weightcache.helmLabels" .root }}
{{- end -}}

{{/* Helm's own labels, on every object the chart makes (deploy/ has none of them). */}}
{{- define "weightcache.helmLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The CEL string of the daemon's user name: the node policy matches it exactly. */}}
{{- define "weightcache.daemonUser" -}}
{{- printf "system:serviceaccount:%s:weightcache-daemon" (include "weightcache.namespace" .) -}}
{{- end -}}

{{/* The objects of one deploy/ file (files/ holds symlinks to them: one source for both install roads), moved into
     the chart's namespace and labelled by Helm; the few fields a value changes are set here by kind.
     tests/test_helm_chart.py compares the result with kustomize's rendering object by object. */}}
{{- define "weightcache.deployFile" -}}
{{- $root := .root }}
{{- $ns := include "weightcache.namespace" $root }}
{{- $text := $root.Files.Get .file }}
{{- if not $text }}{{ fail (printf "chart file %s is missing or empty (a dangling symlink into deploy/?)" .file) }}{{ end }}
{{- range $doc := regexSplit "(?m)^---[ \t]*$" $text -1 }}
{{- $o := fromYaml $doc }}
{{- if hasKey $o "Error" }}{{ fail (printf "%s: %s" $.file $o.Error) }}{{ end }}
{{- if $o.kind }}
{{- $meta := $o.metadata }}
{{- /* "default" is where Events about cluster-scoped objects must live: the events Role stays there */}}
{{- if and $meta.namespace (ne $meta.namespace "default") }}{{ $_ := set $meta "namespace" $ns }}{{ end }}
{{- range $s := ($o.subjects | default list) }}
{{- if eq $s.kind "ServiceAccount" }}{{ $_ := set $s "namespace" $ns }}{{ end }}
{{- end }}
{{- if $o.spec }}
{{- range $c := ($o.spec.matchConditions | default list) }}
{{- $_ := set $c "expression" (replace "system:serviceaccount:weightcache:" (printf "system:serviceaccount:%s:" $ns) $c.expression) }}
{{- end }}
{{- end }}
{{- $_ := set $meta "labels" (merge (fromYaml (include "weightcache.helmLabels" $root)) ($meta.labels | default dict)) }}
{{- if eq $o.kind "ServiceAccount" }}
{{- with $root.Values.serviceAccount.annotations }}{{ $_ := set $meta "annotations" (merge (deepCopy .) ($meta.annotations | default dict)) }}{{ end }}
{{- end }}
{{- if eq $o.kind "DaemonSet" }}
{{- $pod := $o.spec.template.spec }}
{{- range $c := concat ($pod.initContainers | default list) $pod.containers }}
{{- if hasPrefix "ghcr.io/weightcache/weightcache:" $c.image }}{{ $_ := set $c "image" (include "weightcache.image" $root) }}{{ $_ := set $c "imagePullPolicy" $root.Values.image.pullPolicy }}{{ end }}
{{- end }}
{{- with $root.Values.imagePullSecrets }}{{ $_ := set $pod "imagePullSecrets" . }}{{ end }}
{{- range $v := $pod.volumes }}
{{- if and $v.hostPath (hasPrefix "/var/lib/kubelet/" $v.hostPath.path) }}
{{- $_ := set $v.hostPath "path" (printf "%s/%s" (trimSuffix "/" $root.Values.kubeletDir) (trimPrefix "/var/lib/kubelet/" $v.hostPath.path)) }}
{{- end }}
{{- end }}
{{- end }}
{{- if eq $o.kind "DeviceClass" }}
{{- $_ := set $o "apiVersion" (printf "resource.k8s.io/%s" $root.Values.dra.resourceApiVersion) }}
{{- end }}
{{- if and (eq $o.kind "ValidatingAdmissionPolicy") (eq $meta.name "weightcache-model-claims") }}
{{- range $r := $o.spec.matchConstraints.resourceRules }}{{ $_ := set $r "apiVersions" (list $root.Values.dra.resourceApiVersion) }}{{ end }}
{{- end }}
{{- if eq $o.kind "PodMonitor" }}
{{- range $e := $o.spec.podMetricsEndpoints }}{{ $_ := set $e "interval" $root.Values.prometheus.interval }}{{ end }}
{{- end }}
{{- if eq $o.kind "ResourceQuota" }}
{{- range $e := $o.spec.scopeSelector.matchExpressions }}
{{- $_ := set $e "values" (list $root.Values.priorityClassNames.node $root.Values.priorityClassNames.webhook) }}
{{- end }}
{{- end }}
---
# Source: deploy/{{ trimPrefix "files/" $.file }}
{{ toYaml $o }}
{{- end }}
{{- end }}
{{- end -}}
