"""The istio-cni node agent and CNI plugin for ambient mode: pod watch, in-pod redirection, ZDS."""
