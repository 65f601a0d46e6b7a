"""Protocols: the maths of each scheme, testable in one process, found by name."""

from fedcore.protocols._base import (
    ClientProtocol,
    KdcProtocol,
    KeyChannel,
    Protocol,
    RoundResult,
    ServerProtocol,
    Weights,
)
from fedcore.protocols._registry import create_protocol, register_protocol, registered_protocols
from fedcore.protocols.fedavg import FedAvg
from fedcore.protocols.fedsgd import FedSgd

register_protocol(FedAvg.name, FedAvg)
register_protocol(FedSgd.name, FedSgd)

__all__ = [
    "ClientProtocol",
    "FedAvg",
    "FedSgd",
    "KdcProtocol",
    "KeyChannel",
    "Protocol",
    "RoundResult",
    "ServerProtocol",
    "Weights",
    "create_protocol",
    "register_protocol",
    "registered_protocols",
]
