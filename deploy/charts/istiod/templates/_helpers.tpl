{{- define "istiod.labels" -}}
app: istiod
istio: pilot
app.kubernetes.io/name: istiod
app.kubernetes.io/part-of: istio
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "istiod.selector" -}}
app: istiod
istio: pilot
{{- end }}
