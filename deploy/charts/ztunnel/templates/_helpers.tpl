{{- define "ztunnel.labels" -}}
app: ztunnel
app.kubernetes.io/name: ztunnel
app.kubernetes.io/part-of: istio
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "ztunnel.istiod" -}}
{{ .Values.istiodAddress | default (printf "istiod.%s.svc:15012" .Release.Namespace) }}
{{- end }}
