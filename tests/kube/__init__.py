"""A real Kubernetes 1.20 control plane on loopback and a fake kubelet that runs pods locally."""
