"""In-memory execution: a run's protocol in one process, no network and no processes.

``central`` runs the protocols with a server (the same round policy as the server role,
``fedcore.rounds``); ``peer`` runs the decentralized ones over an in-memory peer network.
``fedcore run --simulate``, the audit, unit tests and benchmarks use them.
"""

from fedcore.simulation.central import LocalKeyChannel, Observer, SimulationResult, simulate

__all__ = ["LocalKeyChannel", "Observer", "SimulationResult", "simulate"]
