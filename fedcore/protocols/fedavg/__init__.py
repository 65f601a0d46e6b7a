"""FedAvg (McMahan et al. 2017) and its robust variants: ``protocol`` (the model-averaging server
and local-training client), ``robust`` (a robust aggregator's or IFCA's server and client) and
``aggregators`` (Median, TrimmedMean, Krum, FLTrust, RFCA: pure functions).
"""

from fedcore.protocols.fedavg.protocol import FedAvg, LocalTrainingClient, ModelAveragingServer

__all__ = ["FedAvg", "LocalTrainingClient", "ModelAveragingServer"]
