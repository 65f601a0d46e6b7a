"""Options of ``dp-fedavg``: FedAvg with per-client clipping and central Gaussian noise."""

from __future__ import annotations

from pydantic import Field

from fedcore.spec._base import SpecModel


class DpFedAvgOptions(SpecModel):
    """Options of the ``dp-fedavg`` protocol (McMahan et al., ICLR 2018)."""

    clipping_norm: float = Field(
        1.0,
        gt=0,
        le=1e6,
        description="clippingNorm is the L2 bound C on each client's whole model update (local "
        "model minus global model, all tensors together); larger updates are scaled down to it. "
        "Default 1.0.",
    )
    noise_multiplier: float = Field(
        1.0,
        gt=0,
        le=1e6,
        description="noiseMultiplier z: the server adds Gaussian noise of standard deviation "
        "z*C to the sum of the clipped updates (z*C/m on their mean, m the clients sampled per "
        "round). The accountant composes one Gaussian mechanism of multiplier z each round "
        "with every client every round; with perRound below 100% one of multiplier z/2 under "
        "replace-one adjacency, with no amplification by sampling for a public sample "
        "(spec.clients.sampling Seeded) and sampled without replacement for a secret one "
        "(Secret). Default 1.0.",
    )
    secure_noise: bool = Field(
        True,
        description="secureNoise seeds each round's noise generator from the operating "
        "system's CSPRNG (true, default; a resumed run is then not bit-identical) or from "
        "spec.seed and the round (false: reproducible, for tests only, and warned about: anyone "
        "who knows the seed can remove the noise).",
    )
