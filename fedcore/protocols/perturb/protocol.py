"""perturb: accuracy-lossless model perturbation; clients only ever see a perturbed model.

Yang, Feng, Fang, Shao, Tang, Xia and Lu, "An Accuracy-Lossless Perturbation Method for
Defending Privacy Attacks in Federated Learning" (seed 001; the implementer's digest is
``shared/digests/001_accuracy_lossless_model_perturbation.md``, cited below by section).

Each round the server draws fresh secrets (§2.2 S1): a strictly positive scale per hidden
neuron, a secret scale per cell of a public partition of the outputs, and the public output
noise r^(a). It sends every sampled client the perturbed model W^^ (Eqs. 7-9) with r^(a) and
the partition, never the true model. On W^^ each client computes, over its whole shard, the
gradient of ``F.mse_loss`` and the m+1 noise terms (m cell terms, beta) as m+2 reverse passes
(§2.3), and their values. The server removes the noise with its secrets (§2.2 A2), per
client, which gives each client's true full-shard gradient; it checks every recovered
gradient against the neuron balance of a bias-free ReLU network (``balance_residual``) and
raises ``RecoveryError`` past ``spec.protocol.perturb.residualBound``; then it takes fedsgd's
step on the shard-size weighted mean (Theorem 3: exactly FedSGD, to rounding).

The server is trusted: it holds the true model and recovers each client's own gradient
(§7b S4). Against clients the perturbation is obfuscation, not a guarantee: a client can fit
the output noise with its own labels (§7b S2), and W^^ keeps the true model's signs and the
directions of its first-layer rows (§7b S1, S3). See docs/protocols/perturb.md.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from fedcore.errors import ProtocolError, RecoveryError, UploadRefused
from fedcore.learning.training import LocalLearner
from fedcore.privacy import noise_generator
from fedcore.protocols import _relu_mlp
from fedcore.protocols._base import ClientProtocol, Protocol, RoundResult, ServerProtocol, Weights
from fedcore.protocols._bounds import UploadBounds
from fedcore.protocols._maths import check_like, example_count
from fedcore.protocols.fedsgd import GradientStepServer
from fedcore.protocols.perturb.maths import (
    RoundSecrets,
    balance_residual,
    draw_secrets,
    perturb_weights,
    perturbed_terms,
    recover_upload,
    recover_value,
)
from fedcore.spec import FederatedRunSpec
from fedcore.transport import Payload

SECRET_STREAM = 0x001A
"""Keeps the secrets' random stream apart from other uses of the seed (reproducible mode)."""

OUTPUT_NOISE = "perturb/outputNoise"
"""The instruction's tensor that carries the public output noise r^(a)."""


def grad_name(weight: str) -> str:
    """The upload's name for the gradient at the perturbed model of ``weight``."""
    return f"grad/{weight}"


def cells_name(weight: str) -> str:
    """The upload's name for the cell terms of ``weight``.

    For a hidden layer, sigma~_s for every cell s, stacked: shape (m, *weight's shape). For the
    last layer, whose cell terms are rank one (C[:, s] u^T), only the row u (``PerturbedTerms``).
    """
    return f"cells/{weight}"


def beta_name(weight: str) -> str:
    """The upload's name for the beta term of ``weight`` (not sent for the last layer)."""
    return f"beta/{weight}"


@dataclasses.dataclass
class _Round:
    """What the server keeps between planning a round and combining it."""

    round: int
    clients: frozenset[int]
    secrets: RoundSecrets


class PerturbServer(GradientStepServer):
    """Perturbs the model each round, recovers the true gradients, checks them, steps.

    Its state (``state_dict``) is fedsgd's, the true model only: a round's secrets are
    zeroised when the round is combined (or replanned) and never enter a checkpoint.

    Args:
        initial: the initial global model: bias-free linear layers in input-to-output order
            (each of shape (n_l, n_{l-1}), float64), at least one hidden layer.
        learning_rate: the SGD step size.
        residual_bound: the largest ``balance_residual`` accepted for a recovered gradient.
        cells: m, the number of output cells; None: one per output.
        hidden_scale: h, hidden scales are log-uniform on [1/h, h].
        output_scale: b, output noise and cell scales have magnitudes log-uniform on [1/b, b].
        secure_secrets: draw the secrets from the OS CSPRNG (True) or from (seed, round)
            (False: reproducible, for tests only; warned).
        seed: the run's seed, for the reproducible secrets.

    Raises:
        ProtocolError: the model is not a chain of float64 matrices with a hidden layer, or
            ``cells`` exceeds the number of outputs.
    """

    kind = "perturb"

    def __init__(
        self,
        initial: Weights,
        *,
        learning_rate: float,
        residual_bound: float,
        cells: int | None,
        hidden_scale: float,
        output_scale: float,
        secure_secrets: bool,
        seed: int,
        bounds: UploadBounds | None = None,
    ) -> None:
        widths = _layer_widths(initial)
        outputs = widths[-1]
        if cells is not None and not 1 <= cells <= outputs:
            raise ProtocolError(
                f"spec.protocol.perturb.cells is {cells}, but the model has {outputs} outputs; "
                f"allowed: 1 to {outputs}."
            )
        if not (math.isfinite(residual_bound) and residual_bound > 0):
            raise ProtocolError(f"The residual bound must be positive, got {residual_bound}.")
        super().__init__(initial, weighting="ShardSize", learning_rate=learning_rate, bounds=bounds)
        self._widths = widths
        self._cells = outputs if cells is None else cells
        self._residual_bound = float(residual_bound)
        self._hidden_scale = float(hidden_scale)
        self._output_scale = float(output_scale)
        self._secure_secrets = secure_secrets
        self._seed = seed
        self._round: _Round | None = None
        self._upload_template = _upload_layout(initial, self._cells)
        if not secure_secrets:
            warnings.warn(
                "perturb draws its secrets from a generator seeded by spec.seed "
                "(spec.protocol.perturb.secureSecrets is false): every client knows the seed, "
                "so it can redraw the secrets and undo the perturbation. Use it for tests only.",
                UserWarning,
                stacklevel=2,
            )

    @property
    def cells(self) -> int:
        """m, the number of cells of the output partition."""
        return self._cells

    # ----------------------------------------------------------------------------- plan

    def plan_round(self, round: int, clients: Sequence[int]) -> Mapping[int, Payload]:
        """Draws fresh secrets and sends every client the same perturbed model.

        The instruction holds W^^ under the model's weight names, r^(a) as ``OUTPUT_NOISE``
        and the partition in ``meta`` (all public); the true model and the secrets stay here.
        """
        self._discard()
        rng = noise_generator(
            secure=self._secure_secrets, seed=self._seed, round=round, stream=SECRET_STREAM
        )
        secrets = draw_secrets(
            rng,
            self._widths,
            cells=self._cells,
            hidden_spread=self._hidden_scale,
            output_spread=self._output_scale,
        )
        self._round = _Round(round, frozenset(clients), secrets)
        names = list(self._weights)
        perturbed = perturb_weights([self._weights[n] for n in names], secrets)
        tensors = dict(zip(names, perturbed, strict=True))
        tensors[OUTPUT_NOISE] = np.array(secrets.output_noise, copy=True)
        instruction = Payload(
            meta={
                "round": round,
                "cells": self._cells,
                "cell_of_output": [int(cell) for cell in secrets.cell_of_output],
            },
            tensors=tensors,
        )
        return {client: instruction for client in clients}

    # ---------------------------------------------------------------------------- check

    def check_upload(self, round: int, client: int, upload: Payload) -> None:
        """Refuses an upload that is not this round's m+2 terms of a planned client.

        Raises:
            ProtocolError: naming the round and client: the round or client was not planned;
                a tensor is missing, extra, misshapen, not float64 or not finite; or
                ``num_examples``, ``loss``, ``cell_values`` or ``beta_value`` is malformed.
        """
        what = f"upload of client {client} in round {round}"
        planned = self._round
        if planned is None or planned.round != round:
            raise ProtocolError(f"The {what} is for a round that is not open.")
        if client not in planned.clients:
            raise ProtocolError(f"The {what} comes from a client that was not planned.")
        _check_tensors(self._upload_template, upload, what=what)
        self._bounds.check_examples(client, upload, what=what)
        _finite(upload.meta.get("loss"), f"The {what} reports loss")
        _finite(upload.meta.get("beta_value"), f"The {what} reports beta_value")
        values = upload.meta.get("cell_values")
        if not isinstance(values, list) or len(values) != self._cells:
            raise ProtocolError(
                f"The {what} reports cell_values={_short(values)}; a list of {self._cells} "
                f"numbers is needed."
            )
        for value in values:
            _finite(value, f"The {what} reports a cell value")

    # -------------------------------------------------------------------------- combine

    def recover(
        self,
        round: int,
        uploads: Mapping[int, Payload],
        *,
        refused: dict[int, ProtocolError] | None = None,
    ) -> tuple[dict[int, Payload], float]:
        """Removes the noise from each upload and checks each recovered gradient.

        Args:
            round: the round the uploads answer.
            uploads: checked uploads, by client.
            refused: if given, an upload whose recovered gradient fails its check is left out
                and recorded here (client -> its error) instead of raising, unless none recovers:
                one client's bad upload cannot stop the run, while a server whose secrets are
                wrong still stops it.

        Returns:
            Per client, what a fedsgd client would have uploaded (the true full-shard gradient
            under the model's names; ``num_examples``; the true ``loss``), and the largest
            residual.

        Raises:
            ProtocolError: the round is not open, or a client was not planned.
            RecoveryError: a recovered gradient's residual passes the bound (or is not
                finite); it names the round, the client, the residual and the bound.
        """
        planned = self._round
        if planned is None or planned.round != round:
            raise ProtocolError(f"Round {round} was not planned; its uploads cannot be recovered.")
        unplanned = sorted(set(uploads) - planned.clients)
        if unplanned:
            raise ProtocolError(f"Round {round} has uploads of unplanned clients {unplanned}.")
        names = list(self._weights)
        true = [self._weights[n] for n in names]
        recovered: dict[int, Payload] = {}
        worst = 0.0
        factors = planned.secrets.scale_factors()  # secret too: zeroised below
        failure: RecoveryError | None = None
        try:
            for client in sorted(uploads):
                try:
                    recovered[client], residual = self._recover_one(
                        round, client, uploads[client], true, factors
                    )
                except RecoveryError as exc:
                    if refused is None:
                        raise
                    refused[client] = exc
                    failure = exc
                    continue
                worst = max(worst, residual)
        finally:
            for factor in factors:
                factor.fill(0.0)
        if failure is not None and not recovered:
            raise failure
        return recovered, worst

    def _recover_one(
        self,
        round: int,
        client: int,
        upload: Payload,
        true: Sequence[np.ndarray],
        factors: Sequence[np.ndarray],
    ) -> tuple[Payload, float]:
        """Recovers and checks one upload; returns fedsgd's upload and the residual."""
        assert self._round is not None
        secrets = self._round.secrets
        names = list(self._weights)
        tensors = upload.tensors
        gradient = recover_upload(
            [tensors[grad_name(n)] for n in names],
            [tensors[cells_name(n)] for n in names[:-1]],
            tensors[cells_name(names[-1])],
            [tensors[beta_name(n)] for n in names[:-1]],
            secrets,
            factors=factors,
        )
        residual = balance_residual(true, gradient)
        if not residual <= self._residual_bound:
            raise RecoveryError(
                f"Round {round}: the gradient recovered from client {client}'s upload fails "
                f"the neuron-balance check: residual {residual:.3e} is over the bound "
                f"{self._residual_bound:.3e} (spec.protocol.perturb.residualBound). The "
                f"secrets or the upload are wrong, or precision was lost; the run stops.",
                round=round,
                residual=residual,
                bound=self._residual_bound,
            )
        loss = recover_value(
            float(upload.meta["loss"]),
            [float(value) for value in upload.meta["cell_values"]],
            float(upload.meta["beta_value"]),
            secrets,
        )
        payload = Payload(
            meta={
                "num_examples": example_count(upload, what=f"upload of client {client}"),
                "loss": loss,
            },
            tensors=dict(zip(names, gradient, strict=True)),
        )
        return payload, residual

    def combine(
        self, round: int, uploads: Mapping[int, Payload], failures: Sequence[int]
    ) -> RoundResult | None:
        """Recovers and checks every upload, then takes fedsgd's step; the secrets go.

        Raises:
            ProtocolError: the round was not planned or an upload is of an unplanned client.
            RecoveryError: every recovered gradient fails the residual check (the server's
                secrets, not one client, are wrong); the model is kept. One that fails alone
                is left out of the round and reported in ``RoundResult.refused``.
        """
        try:
            if not uploads:
                return None
            refused: dict[int, ProtocolError] = {}
            recovered, worst = self.recover(round, uploads, refused=refused)
        finally:
            self._discard()
        # Only a recovered gradient shows the step an upload asks: bounded here, not on arrival.
        for client in sorted(recovered):
            try:
                self._bounds.check_step(
                    self._step_norm(recovered[client]),
                    what=f"recovered gradient of client {client} in round {round}",
                )
            except UploadRefused as exc:
                refused[client] = exc
        accepted = {k: v for k, v in recovered.items() if k not in refused}
        result = super().combine(round, accepted, [*failures, *refused])
        if result is None:
            return RoundResult(participants=0, refused=refused) if refused else None
        return dataclasses.replace(
            result, metrics={**result.metrics, "recovery_residual": worst}, refused=refused
        )

    def _discard(self) -> None:
        """Zeroises and forgets the open round's secrets."""
        if self._round is not None:
            self._round.secrets.zeroise()
            self._round = None


class PerturbClient(ClientProtocol):
    """Computes the gradient and the noise terms at the perturbed model it receives."""

    def __init__(self) -> None:
        self._shapes: tuple[object, dict[str, tuple[int, ...]]] | None = None
        """The model's weight shapes, read once per model (``state_dict`` is slow)."""

    def compute_upload(
        self, round: int, instruction: Payload, learner: LocalLearner, keys: Payload | None
    ) -> Payload:
        """Uploads G^^, the m cell terms and beta (not for the last layer), and their values.

        Raises:
            ProtocolError: the instruction does not fit the learner's model, or the model is
                not float64.
        """
        if self._shapes is None or self._shapes[0] is not learner.model:
            shapes = {name: tuple(t.shape) for name, t in learner.model.state_dict().items()}
            self._shapes = (learner.model, shapes)
        weights, noise, cell_of_output, cells = _read_instruction(instruction, self._shapes[1])
        device = learner.features.device
        dtype = learner.features.dtype
        if dtype != torch.float64:
            raise ProtocolError(
                f"perturb computes in float64, but the client's data and model are {dtype}."
            )
        terms = perturbed_terms(
            [_relu_mlp.as_tensor(w, device) for w in weights.values()],
            learner.features,
            learner.targets,
            torch.from_numpy(noise).to(device),
            torch.from_numpy(cell_of_output).to(device),
            cells,
        )
        names = list(weights)
        tensors: dict[str, np.ndarray] = {
            grad_name(n): g for n, g in zip(names, terms.loss_grad, strict=True)
        }
        tensors.update({cells_name(n): g for n, g in zip(names[:-1], terms.cells, strict=True)})
        tensors[cells_name(names[-1])] = terms.cell_row
        tensors.update({beta_name(n): g for n, g in zip(names[:-1], terms.beta_grads, strict=True)})
        return Payload(
            meta={
                "num_examples": learner.num_examples,
                "loss": terms.loss,
                "steps": 1,
                "cell_values": terms.cell_values,
                "beta_value": terms.beta_value,
            },
            tensors=tensors,
        )


class Perturb(Protocol):
    """Accuracy-lossless model perturbation (see the module docstring)."""

    name = "perturb"

    def create_server(self, spec: FederatedRunSpec, initial: Weights) -> ServerProtocol:
        options = spec.protocol.perturb
        return PerturbServer(
            initial,
            learning_rate=spec.training.optimizer.learning_rate,
            residual_bound=options.residual_bound,
            cells=options.cells,
            hidden_scale=options.hidden_scale,
            output_scale=options.output_scale,
            secure_secrets=options.secure_secrets,
            seed=spec.seed,
            bounds=UploadBounds.of(spec, initial),
        )

    def create_client(self, spec: FederatedRunSpec, index: int) -> ClientProtocol:
        return PerturbClient()


def _upload_layout(initial: Weights, cells: int) -> Weights:
    """Arrays of the shapes and dtype of an upload's tensors, in its order (see ``cells_name``)."""
    names = list(initial)
    layout: Weights = {grad_name(n): np.zeros_like(initial[n]) for n in names}
    layout.update({cells_name(n): np.zeros((cells, *initial[n].shape)) for n in names[:-1]})
    layout[cells_name(names[-1])] = np.zeros(initial[names[-1]].shape[1])
    layout.update({beta_name(n): np.zeros_like(initial[n]) for n in names[:-1]})
    return layout


def _check_tensors(layout: Weights, upload: Payload, *, what: str) -> None:
    """``check_like``, with finiteness read off one sum per tensor on the way that passes.

    A NaN or an infinity makes the sum non-finite; a finite sum therefore proves every entry
    finite, and anything else goes to ``check_like``, which names the first fault (or passes
    an upload whose finite entries merely overflow the sum).
    """
    tensors = upload.tensors
    if list(tensors) == list(layout) and all(
        tensors[name].shape == ref.shape
        and tensors[name].dtype == ref.dtype
        and math.isfinite(float(np.sum(tensors[name])))
        for name, ref in layout.items()
    ):
        return
    check_like(layout, upload, what=what)


def _layer_widths(weights: Weights) -> list[int]:
    """Returns n_0..n_L of a chain of float64 matrices, or raises ProtocolError."""
    shapes = {name: (value.dtype, value.shape) for name, value in weights.items()}
    layers = list(weights.values())
    if len(layers) < 2 or any(w.ndim != 2 or w.dtype != np.float64 for w in layers):
        raise ProtocolError(
            f"perturb needs a bias-free MLP in float64 with at least one hidden layer (only "
            f"weight matrices, at least two); the model's tensors are {shapes}."
        )
    widths = [int(layers[0].shape[1])]
    for layer in layers:
        if layer.shape[1] != widths[-1]:
            raise ProtocolError(
                f"perturb needs the model's weights to chain from input to output; the model's "
                f"tensors are {shapes}."
            )
        widths.append(int(layer.shape[0]))
    return widths


def _read_instruction(
    instruction: Payload, expected: Mapping[str, tuple[int, ...]]
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, int]:
    """Splits an instruction into W^^, r^(a), the partition and m, checked against the model's
    weight shapes ``expected``."""
    tensors = dict(instruction.tensors)
    noise = tensors.pop(OUTPUT_NOISE, None)
    got = {name: tuple(t.shape) for name, t in tensors.items()}
    if got != expected or noise is None:
        raise ProtocolError(
            f"The perturb instruction holds the tensors {got} and "
            f"{'no' if noise is None else 'an'} {OUTPUT_NOISE!r}; the model's are {expected}."
        )
    outputs = _layer_widths(tensors)[-1]
    cells = instruction.meta.get("cells")
    partition = instruction.meta.get("cell_of_output")
    if (
        isinstance(cells, bool)
        or not isinstance(cells, int)
        or not 1 <= cells <= outputs
        or not isinstance(partition, list)
        or len(partition) != outputs
        or any(isinstance(c, bool) or not isinstance(c, int) for c in partition)
        or sorted(set(partition)) != list(range(cells))
        or noise.shape != (outputs,)
    ):
        raise ProtocolError(
            f"The perturb instruction's partition is malformed: cells={_short(cells)}, "
            f"cell_of_output={_short(partition)}, output noise of shape {noise.shape}, for "
            f"{outputs} outputs."
        )
    return tensors, np.asarray(noise, dtype=np.float64), np.asarray(partition, np.int64), cells


def _finite(value: object, what: str) -> float:
    """Returns ``value`` as a float if it is a finite number, else raises ProtocolError."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ProtocolError(f"{what}={_short(value)}; a finite number is needed.")
    return float(value)


def _short(value: object) -> str:
    """A short repr of a value for an error message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
