"""Observability: the run's event log (``events``), each role's Prometheus metrics
(``metrics``) and the Kubernetes status reporter that the server and the operator share
(``kube_status``). Each module is imported on its own (the operator needs no torch)."""
