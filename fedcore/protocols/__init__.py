"""Protocols: the maths of each scheme, testable in one process, found by name."""

from fedcore.protocols._base import (
    ClientProtocol,
    KdcProtocol,
    KeyChannel,
    PeerChannel,
    PeerClientProtocol,
    Protocol,
    RoundResult,
    ServerProtocol,
    Weights,
)
from fedcore.protocols._registry import create_protocol, register_protocol, registered_protocols
from fedcore.protocols.adaptive.protocol import Adaptive
from fedcore.protocols.dp_fedavg import DpFedAvg
from fedcore.protocols.ebscfl.protocol import Ebscfl
from fedcore.protocols.fedavg.protocol import FedAvg
from fedcore.protocols.fedsgd import FedSgd
from fedcore.protocols.lppa.protocol import Lppa
from fedcore.protocols.mpdp.protocol import Mpdp
from fedcore.protocols.perturb.protocol import Perturb
from fedcore.protocols.secagg.protocol import SecAgg

register_protocol(FedAvg.name, FedAvg)
register_protocol(FedSgd.name, FedSgd)
register_protocol(Mpdp.name, Mpdp)
register_protocol(Perturb.name, Perturb)
register_protocol(DpFedAvg.name, DpFedAvg)
register_protocol(Ebscfl.name, Ebscfl)
register_protocol(Lppa.name, Lppa)
register_protocol(Adaptive.name, Adaptive)
register_protocol(SecAgg.name, SecAgg)

__all__ = [
    "Adaptive",
    "ClientProtocol",
    "DpFedAvg",
    "Ebscfl",
    "FedAvg",
    "FedSgd",
    "KdcProtocol",
    "KeyChannel",
    "Lppa",
    "Mpdp",
    "PeerChannel",
    "PeerClientProtocol",
    "Perturb",
    "Protocol",
    "RoundResult",
    "SecAgg",
    "ServerProtocol",
    "Weights",
    "create_protocol",
    "register_protocol",
    "registered_protocols",
]
