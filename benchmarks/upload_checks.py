"""A server's work per upload against the model's tensor count: packed stretches or a tensor
at a time.

An averaging server checks every upload (shapes, example count, finiteness through the step
norm against the model) and folds it into the round's sums (``ModelAveragingServer``,
docs/security.md and docs/architecture.md). Uploads arrive decoded as ``PackedTensors``, so that
work runs once per stretch of tensors of one dtype (``fedcore/protocols/_runs.py``); the other
side gives the server the same arrays as a plain dict, which is worked on a tensor at a time,
as every upload was before 2026-11-28. Three models: the digits MLP of the quickstart (4
tensors), a transformer encoder from torch's own modules (all float32: one stretch) and a
convolutional net of 20 blocks of a 3x3 convolution and a BatchNorm (whose int64 batch counters
split the stretches). K uploads per round, the sides alternating round by round, in one process;
medians of the per-upload time (check + fold) and of the round's combine (the mean).

Run: ``python benchmarks/upload_checks.py [--repeats 30] [--write]`` (``--write`` replaces the
uploads section of docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.measure import load, machine  # noqa: E402
from benchmarks.spine import publish  # noqa: E402
from fedcore.protocols._bounds import UploadBounds  # noqa: E402
from fedcore.protocols.fedavg.protocol import ModelAveragingServer  # noqa: E402
from fedcore.transport import PackedTensors, Payload, decode_chunks, encode_chunks  # noqa: E402

BEGIN = "<!-- uploads:begin -->"
END = "<!-- uploads:end -->"
CLIENTS = 20


def models() -> dict[str, nn.Module]:
    """The three models, seeded."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(20):
        blocks += [nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()]
    layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128)
    return {
        "digits MLP (the quickstart's)": nn.Sequential(
            nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)
        ),
        "transformer encoder, 4 layers of width 64": nn.TransformerEncoder(
            layer, num_layers=4, enable_nested_tensor=False
        ),
        "conv net, 20 blocks of conv 3x3 + BatchNorm": nn.Sequential(*blocks),
    }


def _decoded(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    chunks = encode_chunks(Payload(meta={}, tensors=tensors), chunk_bytes=4 << 20)
    return decode_chunks(chunks, max_message_bytes=1 << 30).tensors


def measure(module: nn.Module, repeats: int) -> dict[str, Any]:
    """Per-upload check + fold and per-round combine, packed against a tensor at a time."""
    initial = {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}
    rng = np.random.default_rng(0)
    packed = []
    for _ in range(CLIENTS):
        noisy = {
            name: np.asarray(value + rng.normal(0, 1e-3, value.shape)).astype(value.dtype)
            if value.dtype.kind == "f"
            else value.copy()
            for name, value in initial.items()
        }
        packed.append(_decoded(noisy))
    plain = [dict(upload) for upload in packed]  # the same arrays, no stretches
    sides = {"packed": packed, "tensor at a time": plain}
    server = ModelAveragingServer(initial, weighting="Uniform", bounds=UploadBounds(1e9))
    times: dict[str, dict[str, list[float]]] = {s: {"upload": [], "combine": []} for s in sides}
    round_ = 0
    for repeat in range(repeats + 3):  # the first rounds warm up, uncounted
        for side, uploads in sides.items():
            server.plan_round(round_, list(range(CLIENTS)))
            started = time.perf_counter()
            for client, tensors in enumerate(uploads):
                upload = Payload(meta={"num_examples": 10}, tensors=tensors)
                server.check_upload(round_, client, upload)
                server.take_upload(round_, client, upload)
            taken = time.perf_counter()
            metas = {client: Payload(meta={"num_examples": 10}) for client in range(CLIENTS)}
            server.combine(round_, metas, [])
            ended = time.perf_counter()
            if repeat >= 3:
                times[side]["upload"].append((taken - started) / CLIENTS)
                times[side]["combine"].append(ended - taken)
            round_ += 1
    stretches = packed[0].runs() if isinstance(packed[0], PackedTensors) else None
    return {
        "tensors": len(initial),
        "bytes": sum(value.nbytes for value in initial.values()),
        "stretches": len(stretches or []),
        "medians": {
            side: {key: statistics.median(values) for key, values in parts.items()}
            for side, parts in times.items()
        },
    }


def run(repeats: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    start = load()
    results = {name: measure(module, repeats) for name, module in models().items()}
    return {
        "machine": machine(),
        "repeats": repeats,
        "load_start": start,
        "load_end": load(),
        "models": results,
    }


def render(data: dict[str, Any]) -> str:
    lines = [
        BEGIN,
        "## A server's work per upload against the model's tensor count",
        "",
        f"`python benchmarks/upload_checks.py --write` ({data['machine']}); {CLIENTS} uploads "
        f"per round, {data['repeats']} rounds per side, the sides alternating round by round in "
        f"one process; medians. Load average (1/5/15 min) {data['load_start']} at the start, "
        f"{data['load_end']} at the end. *Check + fold* is `ModelAveragingServer.check_upload` "
        "and `take_upload` of one upload (shapes, example count, the step norm against the "
        "model, the fold into the round's float64 sums); *combine* is the round's mean, "
        "divided into one buffer per stretch of one dtype. *Packed*: the uploads as the server "
        "decodes them, worked on a stretch of tensors at a time (docs/architecture.md); *a "
        "tensor at a time*: the same arrays in a plain dict, the path every upload took before "
        "2026-11-28.",
        "",
        "| model | tensors | KB | stretches | check + fold, packed (us) "
        "| a tensor at a time (us) | packed / a tensor at a time | combine (us) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, result in data["models"].items():
        packed = result["medians"]["packed"]
        plain = result["medians"]["tensor at a time"]
        lines.append(
            f"| {name} | {result['tensors']} | {result['bytes'] / 1e3:.0f} "
            f"| {result['stretches']} | {packed['upload'] * 1e6:.0f} "
            f"| {plain['upload'] * 1e6:.0f} | {packed['upload'] / plain['upload']:.2f}x "
            f"| {packed['combine'] * 1e6:.0f} |"
        )
    lines += [
        "",
        "Per element the operations are the same either way, and so are the sums' and the "
        "mean's bits (tests/unit/test_fold.py); what the stretches save is numpy's and "
        "Python's cost per call. What is left on the small models is numpy's own passes "
        "(widening float32 to float64, the differences and squares, the weighted add) and the "
        "checks' Python per tensor (names, shapes and dtypes are still compared one by one).",
        END,
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    data = run(args.repeats)
    publish(render(data), data, "uploads", begin=BEGIN, end=END, write=args.write)


if __name__ == "__main__":
    main()
