"""Options of ``mpdp``: MP_Server model perturbation with DDP_Client noise (seed 000)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedcore.spec._base import SpecModel


class MpdpOptions(SpecModel):
    """Options of the ``mpdp`` protocol (digest 000; docs/protocols/mpdp.md)."""

    mode: Literal["Faithful", "Hardened"] = Field(
        "Hardened",
        description="mode of the protocol. Faithful: as the paper: the server's multiplicative "
        "noise and the clients' noise follow the paper's Theorem 3 laws (each client's noise "
        "is Gaussian with std clientNoiseStd after recovery, marginally over the server's "
        "noise) and the correction tensors Psi and Phi travel unmasked, so the server sees "
        "them per client. Hardened (default): Psi, Phi and the loss scalars are masked with "
        "pairwise fixed-point masks, so the server sees only their sum; the server's noise is "
        "kept positive and at least 1, and the clients' noise is Gaussian before recovery, so "
        "given the server's noise the aggregate's noise is Gaussian with std at least "
        "clientNoiseStd/sqrt(K) per entry.",
    )
    graph: Literal["Complete", "NOut"] = Field(
        "NOut",
        description="graph of the pairwise masks among a round's clients. Complete: every pair. "
        "NOut (default): each client picks graphDegree others at random and an edge exists if "
        "either picked the other (seeded per round and participant set).",
    )
    graph_degree: int = Field(
        2,
        ge=1,
        le=1000,
        description="graphDegree n of the NOut graph; n >= (clients per round) - 1 is the "
        "complete graph. Default 2.",
    )
    clipping_norm: float = Field(
        1.0,
        gt=0,
        le=1e6,
        description="clippingNorm B bounds the L2 norm of each client's gradient contribution "
        "as the server recovers it: a client scales its whole upload by min(1, B/bound), where "
        "bound is an upper bound on that norm computed from public per-round bounds on the "
        "server's noise. Applied only when clientNoiseStd > 0. Default 1.0.",
    )
    client_noise_std: float = Field(
        1.0,
        ge=0,
        le=1e6,
        description="clientNoiseStd sigma_eta: the standard deviation of each client's own DP "
        "noise per entry after recovery (at least that in Hardened mode). The accountant "
        "composes noise multiplier sigma_eta*sqrt(K)/B per round, K the round's quorum. 0 "
        "turns DP off (mpdp then equals fedsgd with Uniform weighting and claims no DP). "
        "Default 1.0.",
    )
    pairwise_noise_std: float = Field(
        1.0,
        gt=0,
        le=1e6,
        description="pairwiseNoiseStd sigma_delta: the standard deviation of the pairwise "
        "masks on the gradient, which cancel in the aggregate (to float64 rounding). "
        "Default 1.0.",
    )
    output_noise_std: float = Field(
        0.01,
        gt=0,
        le=1e3,
        description="outputNoiseStd: the standard deviation of each entry of the server's "
        "additive output noise r (the paper leaves its law open). Larger hides the outputs of "
        "the perturbed model more but loosens the clipping bound. Default 0.01.",
    )
