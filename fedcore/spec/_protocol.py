"""Which protocol runs a run's rounds (spec.protocol), with every protocol's options block."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedcore.spec._base import SpecModel
from fedcore.spec._options import (
    AdaptiveOptions,
    DpFedAvgOptions,
    EbscflOptions,
    FedAvgOptions,
    FedSgdOptions,
    LppaOptions,
    MpdpOptions,
    PerturbOptions,
    SecAggOptions,
)

ProtocolName = Literal[
    "fedavg", "fedsgd", "dp-fedavg", "perturb", "mpdp", "lppa", "adaptive", "ebscfl", "secagg"
]


class ProtocolSpec(SpecModel):
    """Which protocol runs the rounds, and its options."""

    name: ProtocolName = Field(
        description="name of the protocol. fedavg: local epochs, weighted model mean. "
        "fedsgd: one gradient step per round, weighted gradient mean. dp-fedavg: fedavg with "
        "per-client clipping and central Gaussian noise (DP). perturb: accuracy-lossless model "
        "perturbation (seed 001). mpdp: model perturbation on the server and distributed DP "
        "noise on the clients (seed 000). lppa: gradient tracking over a peer graph with "
        "zero-sum noise; no server sees model data (seed 002). adaptive: each client's learned "
        "distortion under a privacy budget (seed 003). ebscfl: secure clustered FL with a KDC "
        "and Byzantine filtering (seed 004). secagg: SecAgg+ secure aggregation, robust to clients "
        "dropping out; the server learns only the sum of the survivors' updates. Required."
    )
    fedavg: FedAvgOptions = Field(
        default_factory=FedAvgOptions,
        description="fedavg holds the options of the fedavg protocol; ignored for others.",
    )
    fedsgd: FedSgdOptions = Field(
        default_factory=FedSgdOptions,
        description="fedsgd holds the options of the fedsgd protocol; ignored for others.",
    )
    dp_fedavg: DpFedAvgOptions = Field(
        default_factory=DpFedAvgOptions,
        description="dpFedavg holds the options of the dp-fedavg protocol; ignored for others.",
    )
    perturb: PerturbOptions = Field(
        default_factory=PerturbOptions,
        description="perturb holds the options of the perturb protocol; ignored for others.",
    )
    mpdp: MpdpOptions = Field(
        default_factory=MpdpOptions,
        description="mpdp holds the options of the mpdp protocol; ignored for others.",
    )
    lppa: LppaOptions = Field(
        default_factory=LppaOptions,
        description="lppa holds the options of the lppa protocol; ignored for others.",
    )
    adaptive: AdaptiveOptions = Field(
        default_factory=AdaptiveOptions,
        description="adaptive holds the options of the adaptive protocol; ignored for others.",
    )
    ebscfl: EbscflOptions = Field(
        default_factory=EbscflOptions,
        description="ebscfl holds the options of the ebscfl protocol; ignored for others.",
    )

    secagg: SecAggOptions | None = Field(
        None,
        description="secagg holds the options of the secagg protocol (defaults when unset); "
        "ignored for others.",
    )

    def options(self) -> SpecModel:
        """Returns the options block of the chosen protocol."""
        if self.name == "secagg":
            return self.secagg_options()
        return getattr(self, self.name.replace("-", "_"))  # type: ignore[no-any-return]

    def secagg_options(self) -> SecAggOptions:
        """spec.protocol.secagg, or its defaults (unset: it stays out of the spec's digest,
        which the sites of runs from before it approved)."""
        return self.secagg or SecAggOptions()
