"""How an attacker reads one protocol's messages: the model it is sent, the gradient it uploads.

A ``ProtocolView`` turns the raw instructions and uploads of a protocol into what the attacks
work on: a differentiable function of the broadcast parameters (``BroadcastModel``), the
gradient-like tensors of an upload at those parameters, the first layer's weights, and (for
plaintext protocols) what the other participants contributed to a released update. A new
protocol gets audited by registering its view (``register_view``); protocols that send the
model's own ``state_dict`` and upload a gradient or a trained model need none.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, Literal

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from fedcore.learning.data import dataset_info
from fedcore.learning.models import build_model
from fedcore.privacy import clip_by_global_norm
from fedcore.protocols.dp_fedavg import expected_clients
from fedcore.protocols.secagg.protocol import MASKED_STAGE
from fedcore.spec import FederatedRunSpec
from fedcore.transport import Payload

Forward = Callable[[Mapping[str, torch.Tensor], torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(parameters, flat inputs) -> (outputs, alpha): alpha is the sum of the activations that feed
the last layer (the output shift's factor in the perturbation protocols), per example."""

Tensor = torch.Tensor

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "ReLU": torch.relu,
    "Tanh": torch.tanh,
    "Sigmoid": torch.sigmoid,
}

UpdateKind = Literal["gradient", "update"]
"""``gradient``: a gradient of the mean loss at the broadcast parameters; ``update``: a model
difference after local training (a multi-step proxy, only its direction is matched)."""


@dataclass
class BroadcastModel:
    """The model a client receives, as a differentiable function of its parameters.

    Attributes:
        params: the broadcast parameters by name, float64, without grad.
        forward: the network as a function of (a copy of) ``params`` and flat inputs.
        loss: the training loss, ``MSE`` (against one-hot targets) or ``CrossEntropy``.
    """

    params: dict[str, torch.Tensor]
    forward: Forward
    loss: str

    def outputs(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The outputs and alpha on flat inputs ``x`` (no grad)."""
        with torch.no_grad():
            out, alpha = self.forward(self.params, torch.tensor(np.asarray(x, np.float64)))
        return out.numpy(), alpha.numpy()


class ProtocolView(ABC):
    """One protocol's messages, as an attacker reads them.

    Args:
        spec: the run's spec.
    """

    perturbed: bool = False
    """Whether clients receive a perturbed model whose outputs carry a shift alpha * r."""
    skips: ClassVar[Mapping[str, str]] = MappingProxyType({})
    """Attacks that cannot apply to the protocol's messages, by name, with the reason."""
    received_stage: ClassVar[int | None] = None
    """Multi-stage protocols: the later stage whose response carries a client's update as the
    server receives it (``Recording.stages``); the server's attacks read that response as the
    upload, beside the stage-0 instruction (the broadcast). None: the stage-0 upload."""

    def __init__(self, spec: FederatedRunSpec) -> None:
        self.spec = spec
        self.input_shape, self.num_classes = dataset_info(spec)
        self.input_size = math.prod(self.input_shape)

    @abstractmethod
    def broadcast(self, instruction: Payload) -> BroadcastModel:
        """The model ``instruction`` carries."""

    @abstractmethod
    def server_gradient(
        self, instruction: Payload, upload: Payload
    ) -> tuple[dict[str, np.ndarray], UpdateKind] | None:
        """The upload's gradient-like tensors at the broadcast's parameters (names as there)."""

    @abstractmethod
    def first_layer(self, instruction: Payload) -> np.ndarray | None:
        """The broadcast's first weight matrix (rows by input), or None if not an MLP."""

    def models(self, instruction: Payload) -> list[BroadcastModel]:
        """Every model ``instruction`` carries (clustered protocols: one per cluster; a client
        holds the one with the lowest loss on its shard)."""
        return [self.broadcast(instruction)]

    def upload_rows(self, round: int, client: int, count: int) -> np.ndarray | None:
        """The rows of the client's shard (of ``count``) behind its upload of ``round``, or
        None for the whole shard."""
        return None

    def others_update(
        self,
        before: Payload,
        after: Payload,
        own: Payload,
        sizes: Mapping[int, int],
        attacker: int,
    ) -> dict[str, np.ndarray] | None:
        """The other participants' part of a released step, as a gradient-like tensor.

        Args:
            before: the instruction of round t (the model the attacker trained from).
            after: the instruction of round t+1 (the model after round t's step).
            own: the attacker's own upload in round t.
            sizes: the shard size of every participant of round t (assumed known).
            attacker: the attacker's client index.

        Returns:
            None where the broadcasts are not the true models (the perturbation protocols).
        """
        return None

    def corrections(self, upload: Payload) -> np.ndarray | None:
        """Per-client tensors whose first-layer rows are combinations of the inputs, uploaded
        without noise (None when the protocol uploads none, or only masked)."""
        return None


# ---------------------------------------------------------------------------- plaintext


class PlainView(ProtocolView):
    """fedavg, fedsgd, dp-fedavg and any protocol that sends the model's own ``state_dict``."""

    def __init__(self, spec: FederatedRunSpec) -> None:
        super().__init__(spec)
        module = build_model(spec.model, self.input_shape, self.num_classes, seed=0)
        self._module = module.to(torch.float64).eval()
        self._names = list(self._module.state_dict())
        self._last = _last_linear(self._module)

    def broadcast(self, instruction: Payload) -> BroadcastModel:
        params = {
            name: torch.as_tensor(np.asarray(instruction.tensors[name], np.float64))
            for name in self._names
        }
        if self.spec.model.kind == "MLP":
            return BroadcastModel(params, self._mlp_forward, self.spec.training.loss)
        module, shape, last = self._module, self.input_shape, self._last

        def forward(p: Mapping[str, torch.Tensor], x: torch.Tensor) -> tuple[Tensor, Tensor]:
            seen: list[torch.Tensor] = []
            handle = (
                last.register_forward_hook(lambda _m, args, _o: seen.append(args[0]))
                if last is not None
                else None
            )
            try:
                out = functional_call(module, dict(p), (x.reshape(-1, *shape),))
            finally:
                if handle is not None:
                    handle.remove()
            alpha = seen[0].sum(dim=1) if seen else torch.zeros(out.shape[0], dtype=out.dtype)
            return out, alpha

        return BroadcastModel(params, forward, self.spec.training.loss)

    def _mlp_forward(self, p: Mapping[str, torch.Tensor], x: torch.Tensor) -> tuple[Tensor, Tensor]:
        """The zoo's MLP (Linear + activation per hidden layer) without functional_call."""
        activation = _ACTIVATIONS[self.spec.model.activation]
        h = x.reshape(x.shape[0], -1)
        layers = [n for n in self._names if n.endswith("weight")]
        for j, name in enumerate(layers):
            if j:
                h = activation(h)
            alpha = h.sum(dim=1)
            bias = p.get(name[: -len("weight")] + "bias")
            h = torch.nn.functional.linear(h, p[name], bias)
        return h, alpha

    def server_gradient(
        self, instruction: Payload, upload: Payload
    ) -> tuple[dict[str, np.ndarray], UpdateKind] | None:
        names = [n for n in self._names if n in upload.tensors]
        if self.spec.protocol.name == "fedsgd":
            return {n: np.asarray(upload.tensors[n], np.float64) for n in names}, "gradient"
        return (
            {
                n: np.asarray(instruction.tensors[n], np.float64)
                - np.asarray(upload.tensors[n], np.float64)
                for n in names
            },
            "update",
        )

    def first_layer(self, instruction: Payload) -> np.ndarray | None:
        for name in self._names:
            value = instruction.tensors[name]
            if value.ndim == 2 and value.shape[1] == self.input_size:
                return np.asarray(value, np.float64)
        return None

    def others_update(
        self,
        before: Payload,
        after: Payload,
        own: Payload,
        sizes: Mapping[int, int],
        attacker: int,
    ) -> dict[str, np.ndarray] | None:
        spec = self.spec
        names = [n for n in self._names if np.issubdtype(before.tensors[n].dtype, np.floating)]
        w0 = {n: np.asarray(before.tensors[n], np.float64) for n in names}
        step = {n: w0[n] - np.asarray(after.tensors[n], np.float64) for n in names}
        kind = spec.protocol.name
        if kind == "fedsgd":
            share = _share(spec.protocol.fedsgd.weighting, sizes, attacker)
            rate = spec.training.optimizer.learning_rate
            return {
                n: step[n] / rate - share * np.asarray(own.tensors[n], np.float64) for n in names
            }
        own_update = {n: np.asarray(own.tensors[n], np.float64) - w0[n] for n in names}
        if kind == "dp-fedavg":
            options = spec.protocol.dp_fedavg
            clipped, _ = clip_by_global_norm(own_update, options.clipping_norm)
            m = float(expected_clients(spec))
            return {n: step[n] + clipped[n] / m for n in names}
        if kind == "fedavg":
            share = _share(spec.protocol.fedavg.weighting, sizes, attacker)
            return {n: step[n] + share * own_update[n] for n in names}
        return None


class AdaptiveView(PlainView):
    """adaptive: FedSGD uploads W - eta g + delta, g on a minibatch of the client's private
    rows; the server reads (W - upload) / eta = g - delta / eta as that minibatch's gradient."""

    def server_gradient(
        self, instruction: Payload, upload: Payload
    ) -> tuple[dict[str, np.ndarray], UpdateKind] | None:
        rate = self.spec.training.optimizer.learning_rate
        step, _ = super().server_gradient(instruction, upload) or ({}, "update")
        return {n: v / rate for n, v in step.items()}, "gradient"

    def private_rows(self, client: int, count: int) -> np.ndarray:
        """The client's private rows (the rest of its shard is held out for the distortion)."""
        from fedcore.protocols.adaptive.protocol import AdaptiveClient

        return AdaptiveClient(self.spec, client).split(count)[0]

    def upload_rows(self, round: int, client: int, count: int) -> np.ndarray | None:
        from fedcore.protocols._batches import BATCH_STREAM, batch_rows

        private = self.private_rows(client, count)
        spec = self.spec
        rows = batch_rows(
            len(private),
            spec.training.batch_size,
            seed=spec.seed,
            step=round,
            client=client,
            stream=BATCH_STREAM,
        )
        return private if rows is None else private[rows]

    def others_update(
        self,
        before: Payload,
        after: Payload,
        own: Payload,
        sizes: Mapping[int, int],
        attacker: int,
    ) -> dict[str, np.ndarray] | None:
        """As fedavg's, the server weighting each upload by its private row count."""
        private = {k: len(self.private_rows(k, count)) for k, count in sizes.items()}
        share = private[attacker] / float(sum(private.values()))
        names = [n for n in self._names if np.issubdtype(before.tensors[n].dtype, np.floating)]
        out = {}
        for n in names:
            w0 = np.asarray(before.tensors[n], np.float64)
            step = w0 - np.asarray(after.tensors[n], np.float64)
            out[n] = step + share * (np.asarray(own.tensors[n], np.float64) - w0)
        return out


def _share(weighting: str, sizes: Mapping[int, int], attacker: int) -> float:
    """The attacker's weight in the server's mean (ShardSize or Uniform)."""
    if weighting == "Uniform":
        return 1.0 / len(sizes)
    return sizes[attacker] / float(sum(sizes.values()))


def _last_linear(module: nn.Module) -> nn.Linear | None:
    """The network's last ``nn.Linear`` (its input is what alpha sums)."""
    last = None
    for child in module.modules():
        if isinstance(child, nn.Linear):
            last = child
    return last


# ----------------------------------------------------------------------- perturbation


def _chain(
    layers: Sequence[torch.Tensor], diagonals: Sequence[torch.Tensor] | None, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A bias-free ReLU chain (optionally times transitional diagonals); (outputs, alpha)."""
    h = x
    for j, weight in enumerate(layers[:-1]):
        h = torch.relu(h @ weight.T)
        if diagonals is not None:
            h = h * diagonals[j]
    return h @ layers[-1].T, h.sum(dim=1)


class PerturbView(ProtocolView):
    """perturb: W^^ under the model's names, plus the public output noise; uploads G^^ etc."""

    perturbed = True

    def broadcast(self, instruction: Payload) -> BroadcastModel:
        from fedcore.protocols.perturb.protocol import OUTPUT_NOISE

        names = [n for n in instruction.tensors if n != OUTPUT_NOISE]
        params = {n: torch.as_tensor(np.asarray(instruction.tensors[n], np.float64)) for n in names}

        def forward(p: Mapping[str, torch.Tensor], x: torch.Tensor) -> tuple[Tensor, Tensor]:
            return _chain([p[n] for n in names], None, x.reshape(x.shape[0], -1))

        return BroadcastModel(params, forward, "MSE")

    def server_gradient(
        self, instruction: Payload, upload: Payload
    ) -> tuple[dict[str, np.ndarray], UpdateKind] | None:
        from fedcore.protocols.perturb.protocol import OUTPUT_NOISE, grad_name

        names = [n for n in instruction.tensors if n != OUTPUT_NOISE]
        return {n: np.asarray(upload.tensors[grad_name(n)], np.float64) for n in names}, "gradient"

    def first_layer(self, instruction: Payload) -> np.ndarray | None:
        from fedcore.protocols.perturb.protocol import OUTPUT_NOISE

        first = next(n for n in instruction.tensors if n != OUTPUT_NOISE)
        return np.asarray(instruction.tensors[first], np.float64)


class MpdpView(ProtocolView):
    """mpdp: odd layers ``w.j`` and transitional diagonals ``t.j``; uploads ``g.j`` (noised,
    masked), and ``psi.j``, ``phi.j`` (in the clear in Faithful mode, masked in Hardened)."""

    perturbed = True

    def broadcast(self, instruction: Payload) -> BroadcastModel:
        layers = sum(1 for name in instruction.tensors if name.startswith("w."))
        params = {
            f"w.{j}": torch.as_tensor(np.asarray(instruction.tensors[f"w.{j}"], np.float64))
            for j in range(layers)
        }
        diagonals = [
            torch.as_tensor(np.asarray(instruction.tensors[f"t.{j}"], np.float64))
            for j in range(layers - 1)
        ]

        def forward(p: Mapping[str, torch.Tensor], x: torch.Tensor) -> tuple[Tensor, Tensor]:
            flat = x.reshape(x.shape[0], -1)
            return _chain([p[f"w.{j}"] for j in range(layers)], diagonals, flat)

        return BroadcastModel(params, forward, "MSE")

    def server_gradient(
        self, instruction: Payload, upload: Payload
    ) -> tuple[dict[str, np.ndarray], UpdateKind] | None:
        layers = sum(1 for name in instruction.tensors if name.startswith("w."))
        return {
            f"w.{j}": np.asarray(upload.tensors[f"g.{j}"], np.float64) for j in range(layers)
        }, "gradient"

    def first_layer(self, instruction: Payload) -> np.ndarray | None:
        return np.asarray(instruction.tensors["w.0"], np.float64)

    def corrections(self, upload: Payload) -> np.ndarray | None:
        phi, psi = upload.tensors.get("phi.0"), upload.tensors.get("psi.0")
        if phi is None or psi is None or phi.dtype != np.float64:
            return None  # Hardened: fixed-point words under uniform masks
        return np.concatenate([phi, psi.reshape(-1, psi.shape[-1])])


# ------------------------------------------------------------------- secure aggregation


class SecAggView(PlainView):
    """secagg: the stage-0 instruction is the global model (read as PlainView reads it); the
    server sees a client's update only as its stage-2 masked input (``masked``, uint64 words
    mod 2^bits: the clipped, quantized update plus a self mask and pairwise masks).

    ``server_gradient`` reads those words as a server that ignores the masks would: as if they
    were the client's levels, each coordinate ``word * 2c / (levels - 1) - c`` (c the clip
    range, levels 2^quantizationBits), in the broadcast's floating-point tensors in order
    (``float_names``), then as fedavg's upload (the broadcast minus the trained model, that is
    minus the update). The masks make the words uniform over [0, 2^bits), and 2^bits exceeds
    the levels, so the reading lies anywhere in [-c, (2^bits - 1) 2c / (levels - 1) - c]: what
    the inversions get is noise, unless the masks fail.
    """

    received_stage = MASKED_STAGE
    skips: ClassVar[Mapping[str, str]] = MappingProxyType(
        {
            "differencing-inversion": "no secagg message carries the attacker's own update in "
            "the clear, so the recording cannot give its part of the released mean to subtract "
            "(a real client knows it: the released mean leaks to differencing as fedavg's "
            "does; not audited here)",
        }
    )

    def server_gradient(
        self, instruction: Payload, upload: Payload
    ) -> tuple[dict[str, np.ndarray], UpdateKind] | None:
        from fedcore.protocols.secagg.protocol import MASKED, float_names

        words = upload.tensors.get(MASKED)
        if words is None:
            return None  # not a masked input (the stage-0 advert carries no tensor)
        options = self.spec.protocol.secagg_options()
        clip, levels = options.clip_range, 2**options.quantization_bits
        values = np.asarray(words, np.uint64).astype(np.float64) * (2 * clip / (levels - 1)) - clip
        names = float_names(instruction.tensors)
        sizes = [int(np.size(instruction.tensors[n])) for n in names]
        if values.size != sum(sizes):
            return None
        out, at = {}, 0
        for name, size in zip(names, sizes, strict=True):
            update = values[at : at + size].reshape(np.shape(instruction.tensors[name]))
            at += size
            if name in self._names:
                out[name] = -update  # the broadcast minus the "trained" model, as fedavg's
        return out, "update"

    def others_update(
        self,
        before: Payload,
        after: Payload,
        own: Payload,
        sizes: Mapping[int, int],
        attacker: int,
    ) -> dict[str, np.ndarray] | None:
        return None  # skipped (``skips``): the attacker's own update is not in its messages


# ----------------------------------------------------------------------------- registry

_VIEWS: dict[str, Callable[[FederatedRunSpec], ProtocolView]] = {
    "fedavg": PlainView,
    "fedsgd": PlainView,
    "dp-fedavg": PlainView,
    "perturb": PerturbView,
    "mpdp": MpdpView,
    "adaptive": AdaptiveView,
    "secagg": SecAggView,
}


def register_view(protocol: str, factory: Callable[[FederatedRunSpec], ProtocolView]) -> None:
    """Registers how the audit reads ``protocol``'s messages (replacing any earlier view)."""
    _VIEWS[protocol] = factory


def view_for(spec: FederatedRunSpec) -> ProtocolView:
    """The view of the run's protocol; PlainView for protocols without a registered one."""
    return _VIEWS.get(spec.protocol.name, PlainView)(spec)
