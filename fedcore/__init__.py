"""fedcore: privacy-preserving federated learning, on one machine or on Kubernetes."""

__version__ = "0.1.0"
