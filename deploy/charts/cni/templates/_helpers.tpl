{{- define "cni.labels" -}}
k8s-app: istio-cni-node
app.kubernetes.io/name: istio-cni
app.kubernetes.io/part-of: istio
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}
