"""Models of a run: build the network a manifest names and move its weights as numpy arrays."""

from fedcore.learning.models._weights import get_weights, release_storage, set_weights
from fedcore.learning.models._zoo import build_model, model_bytes

__all__ = ["build_model", "get_weights", "model_bytes", "release_storage", "set_weights"]
