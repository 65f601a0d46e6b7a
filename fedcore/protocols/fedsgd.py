"""FedSGD: each client sends the gradient of its whole shard; the server takes one SGD step.

McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data",
AISTATS 2017, https://arxiv.org/abs/1602.05629 (the FedSGD baseline). With shard-size
weighting this is exactly full-batch gradient descent on the union of the shards.
"""

from __future__ import annotations

import numpy as np

from fedcore.learning.training import LocalLearner
from fedcore.protocols._base import ClientProtocol, Protocol, ServerProtocol, Weights
from fedcore.protocols._bounds import UploadBounds, step_norm
from fedcore.protocols.fedavg.protocol import ModelAveragingServer
from fedcore.spec import FederatedRunSpec
from fedcore.transport import Payload


class GradientStepServer(ModelAveragingServer):
    """Averages the clients' gradients and takes one SGD step with the spec's learning rate."""

    kind = "fedsgd"

    def __init__(
        self,
        initial: Weights,
        *,
        weighting: str,
        learning_rate: float,
        bounds: UploadBounds | None = None,
    ) -> None:
        super().__init__(initial, weighting=weighting, bounds=bounds)
        self._learning_rate = learning_rate

    def _step_norm(self, upload: Payload) -> float:
        """The norm of the step the gradient would take alone: learning rate x ||gradient||."""
        return step_norm(upload.tensors, scale=self._learning_rate)

    def _apply(self, mean: Weights) -> Weights:
        current = self.global_weights()
        return {
            name: (current[name] - np.asarray(self._learning_rate, dtype=value.dtype) * mean[name])
            for name, value in current.items()
        }


class GradientClient(ClientProtocol):
    """Uploads the mean-loss gradient over the whole local shard."""

    def compute_upload(
        self, round: int, instruction: Payload, learner: LocalLearner, keys: Payload | None
    ) -> Payload:
        gradient, stats = learner.gradient(instruction.tensors, round=round)
        return Payload(
            meta={"num_examples": stats.num_examples, "loss": stats.loss, "steps": 1},
            tensors=gradient,
        )


class FedSgd(Protocol):
    """Federated SGD (see the module docstring)."""

    name = "fedsgd"

    def create_server(self, spec: FederatedRunSpec, initial: Weights) -> ServerProtocol:
        return GradientStepServer(
            initial,
            weighting=spec.protocol.fedsgd.weighting,
            learning_rate=spec.training.optimizer.learning_rate,
            bounds=UploadBounds.of(spec, initial),
        )

    def create_client(self, spec: FederatedRunSpec, index: int) -> ClientProtocol:
        return GradientClient()
