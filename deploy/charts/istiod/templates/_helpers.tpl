{{- /* The revision (istio.io/rev) this release is, as Istio's chart: "" or "default" keeps Istio's
unsuffixed names; another takes the suffix -<revision> (istiod-<rev>, istio-<rev>, ...). */}}
{{- define "istiod.revision" -}}
{{ .Values.revision | default "default" }}
{{- end }}

{{- define "istiod.suffix" -}}
{{- if and .Values.revision (ne .Values.revision "default") }}-{{ .Values.revision }}{{ end }}
{{- end }}

{{- define "istiod.labels" -}}
app: istiod
istio: {{ ternary "istiod" "pilot" (ne (include "istiod.suffix" .) "") }}
istio.io/rev: {{ include "istiod.revision" . | quote }}
app.kubernetes.io/name: istiod
app.kubernetes.io/part-of: istio
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- /* As Istio's: the default revision's pods are `istio: pilot`, a revision's are its istio.io/rev, so
the default Service never picks a canary's pods. */}}
{{- define "istiod.selector" -}}
app: istiod
{{- if include "istiod.suffix" . }}
istio.io/rev: {{ .Values.revision | quote }}
{{- else }}
istio: pilot
{{- end }}
{{- end }}
