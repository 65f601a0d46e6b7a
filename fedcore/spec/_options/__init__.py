"""Per-protocol option blocks and preconditions: one module per protocol (no torch here)."""

from fedcore.spec._options.adaptive import AdaptiveOptions
from fedcore.spec._options.dp_fedavg import DpFedAvgOptions
from fedcore.spec._options.ebscfl import EbscflOptions
from fedcore.spec._options.fedavg import FedAvgOptions
from fedcore.spec._options.fedsgd import FedSgdOptions
from fedcore.spec._options.lppa import LppaOptions
from fedcore.spec._options.mpdp import MpdpOptions
from fedcore.spec._options.perturb import PerturbOptions
from fedcore.spec._options.secagg import SecAggOptions

__all__ = [
    "AdaptiveOptions",
    "DpFedAvgOptions",
    "EbscflOptions",
    "FedAvgOptions",
    "FedSgdOptions",
    "LppaOptions",
    "MpdpOptions",
    "PerturbOptions",
    "SecAggOptions",
]
