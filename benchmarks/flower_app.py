"""The digits job as a Flower app (ServerApp + ClientApp), run only inside Flower's own venv.

The benchmark (benchmarks/flower.py) copies this file into a Flower app folder with a
generated pyproject.toml and runs it in Flower's simulation mode (``run_simulation``, the Ray
backend) and deployment mode (``flower-superlink`` + one ``flower-supernode`` process per client,
``flwr run``). It is never imported by fedcore.

The maths is the floor's (benchmarks/floor.py): digits with features /16, an 80/20 split with
seed 0, IID shards from one seeded permutation, MLP 64-128-ReLU-10 initialised under
``torch.manual_seed(0)``, SGD lr 0.1, one local epoch of batch 32 in a per-(round, client)
seeded order, FedAvg weighted by shard size (Flower's ``FedAvg`` with ``num-examples``), and
the held-out accuracy evaluated on the server after every round. The ServerApp writes the
time of every round boundary and the final accuracy to the JSON file named by the run config
key ``out``.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from functools import cache
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

SEED = 0
LR = 0.1
BATCH = 32

torch.set_num_threads(1)


@cache
def dataset() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits, features /16, the 80/20 split with seed 0: (x_train, y_train, x_test, y_test)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0)
    return (
        torch.from_numpy(x_tr),
        torch.from_numpy(y_tr.astype(np.int64)),
        torch.from_numpy(x_te),
        torch.from_numpy(y_te.astype(np.int64)),
    )


def shard(partition: int, partitions: int) -> np.ndarray:
    """The IID shard of client ``partition``: the floor's seeded permutation, split evenly."""
    perm = np.random.default_rng(SEED).permutation(len(dataset()[0]))
    return np.array_split(perm, partitions)[partition]


def build_model() -> torch.nn.Module:
    """MLP 64-128-ReLU-10, initialised as the floor's."""
    torch.manual_seed(SEED)
    return torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
    )


client = ClientApp()


@client.train()
def train(msg: Message, context: Context) -> Message:
    """One local epoch on this node's shard, starting from the received global model."""
    partition = int(context.node_config["partition-id"])
    partitions = int(context.node_config["num-partitions"])
    round_ = int(msg.content["config"]["server-round"])
    x, y, _, _ = dataset()
    model = build_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = torch.nn.CrossEntropyLoss()
    mine = shard(partition, partitions)
    order = mine[np.random.default_rng([SEED, round_, partition]).permutation(len(mine))]
    for start in range(0, len(order), BATCH):
        idx = torch.from_numpy(order[start : start + BATCH])
        opt.zero_grad()
        loss_fn(model(x[idx]), y[idx]).backward()
        opt.step()
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"num-examples": len(mine)}),
        }
    )
    return Message(content=content, reply_to=msg)


def dump(out: str, marks: list[float], accuracy: list[float]) -> None:
    """Writes the round boundaries so far (wall times) and the latest accuracy to ``out``."""
    result: dict[str, Any] = {
        "marks": marks,
        "accuracy": accuracy[-1],
        "round_seconds": [b - a for a, b in itertools.pairwise(marks)],
    }
    with open(out + ".tmp", "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    os.replace(out + ".tmp", out)


def settings_from_env() -> dict[str, Any]:
    """The run config given through ``FLOWER_BENCH_*`` variables (simulation mode has none)."""
    keys = ("num-server-rounds", "num-nodes", "out")
    names = {key: "FLOWER_BENCH_" + key.upper().replace("-", "_") for key in keys}
    return {key: os.environ[name] for key, name in names.items() if name in os.environ}


server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    """FedAvg over every node for ``num-server-rounds`` rounds; writes the timings as JSON."""
    config = {**settings_from_env(), **context.run_config}
    rounds = int(config["num-server-rounds"])
    nodes = int(config["num-nodes"])
    out = str(config["out"])
    model = build_model()
    _, _, x_te, y_te = dataset()
    marks: list[float] = []
    accuracy: list[float] = []

    def evaluate(round_: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        with torch.no_grad():
            acc = float((model(x_te).argmax(1) == y_te).double().mean())
        accuracy.append(acc)
        marks.append(time.time())
        dump(out, marks, accuracy)
        return MetricRecord({"accuracy": acc})

    strategy = FedAvg(
        fraction_train=1.0,
        fraction_evaluate=0.0,
        min_train_nodes=nodes,
        min_available_nodes=nodes,
    )
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=rounds,
        train_config=None,
        evaluate_fn=evaluate,
    )
    with open(out + ".done", "w", encoding="utf-8") as handle:
        handle.write("done\n")


def simulate(nodes: int, rounds: int, out: str) -> None:
    """Runs the app in Flower's simulation mode: Ray actors, one CPU per client actor."""
    from flwr.simulation import run_simulation

    os.environ.update(
        {
            "FLOWER_BENCH_NUM_SERVER_ROUNDS": str(rounds),
            "FLOWER_BENCH_NUM_NODES": str(nodes),
            "FLOWER_BENCH_OUT": out,
        }
    )
    run_simulation(
        server_app=server,
        client_app=client,
        num_supernodes=nodes,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
