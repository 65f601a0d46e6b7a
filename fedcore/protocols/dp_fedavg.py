"""dp-fedavg: FedAvg with per-client update clipping and central Gaussian noise (client-level DP).

McMahan, Ramage, Talwar and Zhang, "Learning Differentially Private Recurrent Language
Models", ICLR 2018, https://arxiv.org/abs/1710.06963 (DP-FedAvg with the fixed-denominator
estimator). Each sampled client trains locally as in fedavg and uploads its model; the server
takes each update Δ_k = local_k - global, clips it to L2 norm C as a whole, averages with the
fixed denominator m (the clients sampled per round, so one client moves the mean by at most
C/m), adds N(0, (z·C/m)²) noise per coordinate and sets global ← global + noisy mean. The
runtime's accountant composes one Poisson-sampled Gaussian mechanism of multiplier z per round.

The server sees every individual update before the noise: it must be trusted. What is
protected is the released model (every global model after a round), against anyone who sees
it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence

import numpy as np

from fedcore.errors import ProtocolError
from fedcore.privacy import clip_by_global_norm, gaussian_noise_like, noise_generator
from fedcore.protocols._base import (
    ClientProtocol,
    Protocol,
    RoundResult,
    ServerProtocol,
    Weights,
)
from fedcore.protocols._bounds import UploadBounds
from fedcore.protocols._maths import mean_loss
from fedcore.protocols.fedavg.protocol import LocalTrainingClient, ModelAveragingServer
from fedcore.spec import FederatedRunSpec
from fedcore.transport import Payload


class DpFedAvgServer(ModelAveragingServer):
    """Clips each client's update, averages over a fixed m, adds Gaussian noise, applies it.

    Only floating-point tensors are updated; any other tensor (e.g. an integer step counter
    buffer) keeps the global model's value, since noise cannot be added to it.

    Args:
        initial: the initial global model.
        clipping_norm: C, the L2 bound on each client's whole update.
        noise_multiplier: z; the noise's standard deviation per coordinate of the mean is
            z·C/m.
        expected_clients: m, the fixed denominator: the clients sampled per round.
        secure_noise: whether each round's noise comes from a CSPRNG-seeded generator (True)
            or from one seeded by (seed, round) (False: reproducible, for tests only; warned).
        seed: the run's seed (``spec.seed``), for the reproducible noise.
        bounds: the run's upload bounds, checked on each upload before clipping.

    Raises:
        ValueError: C or z is not positive and finite, m is below 1, or the seed is negative.
    """

    kind = "dp-fedavg"
    streams_uploads = False  # combine clips each update whole

    def __init__(
        self,
        initial: Weights,
        *,
        clipping_norm: float,
        noise_multiplier: float,
        expected_clients: int,
        secure_noise: bool,
        seed: int,
        bounds: UploadBounds | None = None,
    ) -> None:
        if not (math.isfinite(clipping_norm) and clipping_norm > 0):
            raise ValueError(f"The clipping norm must be positive and finite, got {clipping_norm}.")
        if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
            raise ValueError(
                f"The noise multiplier must be positive and finite, got {noise_multiplier}."
            )
        if expected_clients < 1:
            raise ValueError(
                f"The expected clients per round must be at least 1, got {expected_clients}."
            )
        if seed < 0:
            raise ValueError(f"The seed must be non-negative, got {seed}.")
        super().__init__(initial, weighting="Uniform", bounds=bounds)
        self._clipping_norm = float(clipping_norm)
        self._noise_multiplier = float(noise_multiplier)
        self._expected_clients = int(expected_clients)
        self._secure_noise = secure_noise
        self._seed = seed
        if not secure_noise:
            warnings.warn(
                "dp-fedavg draws its noise from a generator seeded by spec.seed "
                "(spec.protocol.dpFedavg.secureNoise is false): anyone who knows the seed can "
                "subtract the noise, so this run has no differential privacy. Use it for tests "
                "only.",
                UserWarning,
                stacklevel=2,
            )

    @property
    def noise_std(self) -> float:
        """The standard deviation z·C/m of the noise on each coordinate of the mean update."""
        return self._noise_multiplier * self._clipping_norm / self._expected_clients

    def combine(
        self, round: int, uploads: Mapping[int, Payload], failures: Sequence[int]
    ) -> RoundResult:
        """Applies one DP-FedAvg step; the noise is added even when no upload arrived.

        Raises:
            ProtocolError: more uploads than the fixed denominator m (the sensitivity C/m
                would not hold).
        """
        if len(uploads) > self._expected_clients:
            raise ProtocolError(
                f"Round {round} has {len(uploads)} uploads, more than the {self._expected_clients} "
                f"clients per round that the noise is calibrated for."
            )
        current = self.global_weights()
        names = [name for name, value in current.items() if np.issubdtype(value.dtype, np.floating)]
        base = {name: current[name].astype(np.float64) for name in names}
        total = {name: np.zeros(base[name].shape, dtype=np.float64) for name in names}
        order = sorted(uploads)
        clipped_count = 0
        for client in order:
            update = {
                name: uploads[client].tensors[name].astype(np.float64) - base[name]
                for name in names
            }
            clipped, norm = clip_by_global_norm(update, self._clipping_norm)
            clipped_count += norm > self._clipping_norm
            total = {name: total[name] + clipped[name] for name in names}
        rng = noise_generator(secure=self._secure_noise, seed=self._seed, round=round)
        noise = gaussian_noise_like(total, self.noise_std, rng)
        m = float(self._expected_clients)
        updated = {
            name: (base[name] + (total[name] / m + noise[name])).astype(current[name].dtype)
            if name in total
            else np.array(current[name], copy=True)
            for name in current
        }
        self._weights = updated
        metrics = {"clipped_fraction": clipped_count / len(order)} if order else {}
        return RoundResult(
            participants=len(order),
            train_loss=mean_loss(uploads, dict.fromkeys(order, 1.0)) if order else None,
            metrics=metrics,
        )


class DpFedAvg(Protocol):
    """DP-FedAvg with central Gaussian noise (see the module docstring)."""

    name = "dp-fedavg"

    def create_server(self, spec: FederatedRunSpec, initial: Weights) -> ServerProtocol:
        options = spec.protocol.dp_fedavg
        return DpFedAvgServer(
            initial,
            clipping_norm=options.clipping_norm,
            noise_multiplier=options.noise_multiplier,
            expected_clients=expected_clients(spec),
            secure_noise=options.secure_noise,
            seed=spec.seed,
            bounds=UploadBounds.of(spec, initial),
        )

    def create_client(self, spec: FederatedRunSpec, index: int) -> ClientProtocol:
        return LocalTrainingClient()

    def noise_multiplier(self, spec: FederatedRunSpec) -> float:
        """Returns z: per round, the noise's std over the sum's sensitivity C."""
        return spec.protocol.dp_fedavg.noise_multiplier


def expected_clients(spec: FederatedRunSpec) -> int:
    """Returns m, the fixed denominator: the number of clients sampled each round."""
    return min(spec.clients.sampled_per_round(), spec.clients.count)
