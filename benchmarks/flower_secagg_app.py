"""The digits job under Flower's SecAgg+ (``SecAggPlusWorkflow`` + ``secaggplus_mod``), run only
inside Flower's own venv.

benchmarks/secagg.py copies this file and benchmarks/flower_app.py (whose dataset, shards,
model and constants it imports: the same job) into a folder and runs ``simulate`` there in
Flower's simulation mode (``run_simulation``, the Ray backend). It is never imported by fedcore.

The job is fedcore's secagg job: digits with features /16, an 80/20 split with seed 0, IID
shards, MLP 64-128-ReLU-10 initialised under ``torch.manual_seed(0)``, SGD lr 0.1, one local
epoch of batch 32 in a per-(round, client) seeded order, every client every round, and the
plain (unweighted) mean of the survivors' models: each client reports one example and
``max_weight`` is 1, so SecAgg+'s weight factor is 1 for everyone.

The server is Flower's legacy ``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))`` over a
legacy ``FedAvg`` whose only evaluation is the server's own (``evaluate_fn``); the client is a
``NumPyClient`` behind ``secaggplus_mod``, itself behind ``bytes_mod``, which records the
protobuf size of every message the client receives and answers (what deployment mode would
carry over gRPC).

Dropping: the clients named in ``dropping`` take part in the setup and share-keys stages, then
train at the collect-masked-vectors stage and raise instead of answering, every round. Flower
turns a ClientApp's exception into an error reply, so the server counts them as dropped at once
(fedcore's DropAfterSharing clients likewise decline their masked input with a reply); the
workflow then rebuilds their pairwise masks from their neighbours' shares in the unmask stage.

Everything is configured through the environment variable ``FLOWER_SECAGG`` (JSON: ``nodes``,
``rounds``, ``out``, ``dropping``, ``num_shares``, ``threshold``, ``clipping_range``,
``quantization_range``, ``modulus_range``, ``timeout``). The run writes into the folder
``out``: ``flower.json`` (round boundaries as wall times, accuracy, survivors per round),
``trained-P.npz`` (client P's model after its round-1 training, dropped or not),
``aggregate-1.npz`` (the model the workflow produced in round 1) and ``bytes-P.txt`` (one line
per message: round, bytes received, bytes answered).
"""

from __future__ import annotations

import itertools
import json
import os
import time
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flower_app import BATCH, LR, SEED, build_model, dataset, shard
from flwr.app import Context, Message
from flwr.app.message_type import MessageType
from flwr.client import NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import ndarrays_to_parameters
from flwr.common.serde import message_to_proto
from flwr.server import LegacyContext, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.serverapp import Grid, ServerApp

KEYS = tuple(build_model().state_dict())
"""The model's tensors in the order Flower's NDArrays carry them."""


@cache
def settings() -> dict[str, Any]:
    """The run's configuration (``FLOWER_SECAGG``)."""
    return dict(json.loads(os.environ["FLOWER_SECAGG"]))


class Dropped(RuntimeError):
    """A client dropping out after sharing its keys (raised instead of its masked input)."""


class DigitsClient(NumPyClient):
    """One client of the digits job."""

    def __init__(self, partition: int, partitions: int) -> None:
        self.partition = partition
        self.partitions = partitions

    def fit(
        self, parameters: list[np.ndarray], config: dict[str, Any]
    ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        """One local epoch from the received model; drops here when told to."""
        round_ = int(config["server-round"])
        x, y, _, _ = dataset()
        model = build_model()
        model.load_state_dict(
            {k: torch.from_numpy(np.asarray(v)) for k, v in zip(KEYS, parameters, strict=True)}
        )
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        loss_fn = torch.nn.CrossEntropyLoss()
        mine = shard(self.partition, self.partitions)
        order = mine[np.random.default_rng([SEED, round_, self.partition]).permutation(len(mine))]
        for start in range(0, len(order), BATCH):
            idx = torch.from_numpy(order[start : start + BATCH])
            opt.zero_grad()
            loss_fn(model(x[idx]), y[idx]).backward()
            opt.step()
        trained = [v.detach().numpy().copy() for v in model.state_dict().values()]
        if round_ == 1:
            out = Path(settings()["out"])
            np.savez(out / f"trained-{self.partition}.npz", *trained)
        if self.partition in settings()["dropping"]:
            raise Dropped(f"client {self.partition} drops after sharing its keys")
        return trained, 1, {}


def client_fn(context: Context) -> Any:
    """The client of this node's partition."""
    partition = int(context.node_config["partition-id"])
    partitions = int(context.node_config["num-partitions"])
    return DigitsClient(partition, partitions).to_client()


def bytes_mod(msg: Message, context: Context, call_next: Any) -> Message:
    """Records the protobuf size of the message received and of the answer (0 for none)."""
    received = message_to_proto(msg).ByteSize()
    answered = 0
    try:
        reply: Message = call_next(msg, context)
        answered = message_to_proto(reply).ByteSize()
        return reply
    finally:
        if msg.metadata.message_type == MessageType.TRAIN:
            partition = int(context.node_config["partition-id"])
            path = Path(settings()["out"]) / f"bytes-{partition}.txt"
            with open(path, "a", encoding="utf-8") as handle:
                handle.write(f"{msg.metadata.group_id} {received} {answered}\n")


client = ClientApp(client_fn=client_fn, mods=[bytes_mod, secaggplus_mod])


def dump(out: Path, marks: list[float], accuracy: list[float], survivors: list[int]) -> None:
    """Writes the round boundaries so far (wall times), accuracy and survivors to flower.json."""
    result = {
        "marks": marks,
        "accuracy": accuracy[-1],
        "round_seconds": [b - a for a, b in itertools.pairwise(marks)],
        "survivors": survivors,
    }
    (out / "flower.json.tmp").write_text(json.dumps(result), encoding="utf-8")
    os.replace(out / "flower.json.tmp", out / "flower.json")


server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    """SecAgg+ over every node for ``rounds`` rounds; writes timings and round 1's model."""
    config = settings()
    nodes, rounds, out = int(config["nodes"]), int(config["rounds"]), Path(config["out"])
    model = build_model()
    _, _, x_te, y_te = dataset()
    marks: list[float] = []
    accuracy: list[float] = []
    survivors: list[int] = []

    def evaluate(
        round_: int, arrays: list[np.ndarray], _: dict[str, Any]
    ) -> tuple[float, dict[str, Any]]:
        if round_ == 1:
            np.savez(out / "aggregate-1.npz", *arrays)
        model.load_state_dict(
            {k: torch.from_numpy(np.asarray(v)) for k, v in zip(KEYS, arrays, strict=True)}
        )
        with torch.no_grad():
            acc = float((model(x_te).argmax(1) == y_te).double().mean())
        accuracy.append(acc)
        marks.append(time.time())
        dump(out, marks, accuracy, survivors)
        return 0.0, {"accuracy": acc}

    class Counting(FedAvg):
        """FedAvg that records how many clients' results each round aggregated."""

        def aggregate_fit(self, server_round: int, results: Any, failures: Any) -> Any:
            survivors.append(len(results))
            return super().aggregate_fit(server_round, results, failures)

    strategy = Counting(
        fraction_fit=1.0,
        fraction_evaluate=0.0,
        min_fit_clients=nodes,
        min_available_clients=nodes,
        evaluate_fn=evaluate,
        on_fit_config_fn=lambda round_: {"server-round": round_},
        initial_parameters=ndarrays_to_parameters([v.numpy() for v in model.state_dict().values()]),
    )
    legacy = LegacyContext(
        context=context, config=ServerConfig(num_rounds=rounds), strategy=strategy
    )
    secagg = SecAggPlusWorkflow(
        num_shares=int(config["num_shares"]),
        reconstruction_threshold=int(config["threshold"]),
        max_weight=1.0,
        clipping_range=float(config["clipping_range"]),
        quantization_range=int(config["quantization_range"]),
        modulus_range=int(config["modulus_range"]),
        timeout=float(config["timeout"]),
    )
    DefaultWorkflow(fit_workflow=secagg)(grid, legacy)
    (out / "flower.json.done").write_text("done\n", encoding="utf-8")


def simulate() -> None:
    """Runs the app in Flower's simulation mode: Ray actors, one CPU per client actor."""
    from flwr.simulation import run_simulation

    run_simulation(
        server_app=server,
        client_app=client,
        num_supernodes=int(settings()["nodes"]),
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
