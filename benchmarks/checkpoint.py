"""The checkpoint benchmark: fedcore checkpoints against raw boto3 on a local S3 server.

For each model size it builds a state of float32 tensors (the shape of a server checkpoint:
``protocol.weights``) and measures, in this one process, alternating, ``--repeats`` times:

* **checkpoint write**: ``Checkpointer.save`` to an ``S3ObjectStore`` with a key, as the server
  writes (state.json, the tensors streamed as a multipart upload, the signed manifest with
  checksums, the latest record, pruning the previous one);
* **encrypted write**: the same with ``encrypt=True``, as the KDC and a decentralized protocol's
  clients write (the tensors sealed with AES-256-GCM in 4 MiB chunks on the way);
* **raw upload**: boto3's ``upload_fileobj`` (its default managed transfer: 8 MiB parts, 10
  threads) of the very bytes of that checkpoint's tensors file;
* **checkpoint read**: ``Checkpointer.load`` (manifest, ranged parallel reads into one
  buffer, checksums, arrays as views of it);
* **encrypted read**: the same of the encrypted checkpoint (the chunks opened in place);
* **raw download**: boto3's ``download_fileobj`` of the same object into memory.

The S3 server is SeaweedFS (``weed mini``, what the tests use) on loopback, started here. It
reports medians of throughput (MB/s, 10^6 bytes), the median of the per-repeat time ratios
checkpoint/raw, and each side's peak memory above what the process held before (peak RSS, from
/proc; the state or the raw bytes themselves are not counted). ``--write`` replaces the
checkpoint section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.spine import write_section
from fedcore.checkpoint import Checkpointer, S3ObjectStore, TensorFile
from tests.integration._s3 import ACCESS_KEY, SECRET_KEY, start_s3

BEGIN = "<!-- checkpoint:begin -->"
END = "<!-- checkpoint:end -->"
BUCKET = "bench"
MB = 10**6
SIDES = (
    "checkpoint write",
    "encrypted write",
    "raw upload",
    "checkpoint read",
    "encrypted read",
    "raw download",
)
KEY = bytes(range(32))
"""The benchmark's checkpoint key (a role's key is 32 random bytes)."""


def peak_extra(action: Callable[[], Any]) -> tuple[float, int]:
    """Runs ``action``; returns its wall seconds and the peak RSS above the RSS before it."""

    def field(name: str) -> int:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
        return 0

    with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")  # the peak (VmHWM) starts again from the current RSS
    before = field("VmRSS")
    started = time.perf_counter()
    result = action()
    seconds = time.perf_counter() - started
    peak = field("VmHWM") - before
    del result
    return seconds, peak


def model_state(size: int) -> dict[str, Any]:
    """A server-checkpoint-shaped state of ``size`` bytes of float32 weights in 8 tensors."""
    rng = np.random.default_rng(0)
    per = size // 8 // 4
    weights = {f"layer{i}.weight": rng.standard_normal(per, dtype=np.float32) for i in range(8)}
    return {"round": 1, "protocol": {"kind": "fedavg", "version": 1, "weights": weights}}


def measure(
    client: Any, endpoint: str, size: int, repeats: int
) -> dict[str, list[dict[str, float]]]:
    """Runs every side ``repeats`` times, alternating; returns seconds and peak bytes."""
    state = model_state(size)
    layout = TensorFile.of(state["protocol"]["weights"])
    raw = b"".join(layout.chunks())
    store = S3ObjectStore(
        BUCKET, prefix=f"ckpt-{size}", endpoint=endpoint, client=client, retry_seconds=60
    )
    signed = Checkpointer(store, run="bench", fingerprint="bench", keep_last=1, key=KEY)
    encrypted = Checkpointer(
        store.child("encrypted"), run="bench", fingerprint="bench", keep_last=1, key=KEY,
        encrypt=True,
    )  # fmt: skip
    raw_key = f"raw-{size}/tensors.safetensors"
    results: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    for repeat in range(repeats):
        steps = _steps(signed, encrypted, client, state, raw, raw_key, repeat + 1)
        if repeat % 2:  # alternate which side goes first
            steps = [*reversed(steps[:3]), *reversed(steps[3:])]
        for side, action in steps:
            seconds, peak = peak_extra(action)
            results[side].append({"seconds": seconds, "peak": peak, "bytes": len(raw)})
        print(
            f"{size / MB:.0f} MB repeat {repeat + 1}: "
            + ", ".join(f"{s} {results[s][-1]['seconds']:.2f} s" for s in SIDES),
            file=sys.stderr,
        )
    for checkpointer in (signed, encrypted):
        loaded = checkpointer.load(repeats)
        for name, array in state["protocol"]["weights"].items():
            assert np.array_equal(loaded["protocol"]["weights"][name], array), name
    return results


def _steps(
    signed: Checkpointer,
    encrypted: Checkpointer,
    client: Any,
    state: dict[str, Any],
    raw: bytes,
    raw_key: str,
    round_: int,
) -> list[tuple[str, Callable[[], Any]]]:
    """The sides of one repeat, in SIDES order (the writes, then the reads)."""
    return [
        ("checkpoint write", lambda: signed.save(round_, state)),
        ("encrypted write", lambda: encrypted.save(round_, state)),
        ("raw upload", lambda: client.upload_fileobj(io.BytesIO(raw), BUCKET, raw_key)),
        ("checkpoint read", lambda: signed.load(round_)),
        ("encrypted read", lambda: encrypted.load(round_)),
        ("raw download", lambda: _download(client, raw_key)),
    ]


def _download(client: Any, key: str) -> io.BytesIO:
    buffer = io.BytesIO()
    client.download_fileobj(BUCKET, key, buffer)
    return buffer


def summarize(results: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    """Medians of throughput and peak memory per side, and the paired time ratios."""
    out: dict[str, float] = {}
    for side, runs in results.items():
        out[f"{side} MB/s"] = statistics.median(r["bytes"] / r["seconds"] / MB for r in runs)
        out[f"{side} peak"] = statistics.median(r["peak"] for r in runs)
    for ours, theirs, name in (
        ("checkpoint write", "raw upload", "write"),
        ("encrypted write", "raw upload", "encrypted write"),
        ("checkpoint read", "raw download", "read"),
        ("encrypted read", "raw download", "encrypted read"),
    ):
        out[f"{name} ratio"] = statistics.median(
            a["seconds"] / b["seconds"] for a, b in zip(results[ours], results[theirs], strict=True)
        )
    return out


def render(rows: dict[int, dict[str, float]], repeats: dict[int, int]) -> str:
    """The markdown section for docs/benchmarks.md."""
    import boto3

    import fedcore

    def mib(value: float) -> str:
        return f"{value / 2**20:.0f}"

    lines = [
        BEGIN,
        "## Checkpoints to S3 against raw boto3",
        "",
        f"Measured {dt.date.today().isoformat()} by `python benchmarks/checkpoint.py --write` on "
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"boto3 {boto3.__version__}, fedcore {fedcore.__version__}, against SeaweedFS "
        "(`weed mini`) on loopback, on the same disk; each size "
        + ", ".join(f"{size / MB:.0f} MB: {n} repeats" for size, n in repeats.items())
        + ", the six sides alternating; medians shown.",
        "",
        "The state is 8 float32 tensors (`protocol.weights`). *Signed write* is "
        "`Checkpointer.save` with a key, as the server writes (state.json, the tensors streamed "
        "as a multipart upload of 16 MiB parts, 4 at a time, sha256 computed on the way, the "
        "signed manifest and latest record last, the previous checkpoint pruned); *encrypted "
        "write* is the same with the parts encrypted, as the KDC and a decentralized protocol's "
        "clients write (AES-256-GCM, the tensors in 4 MiB chunks sealed on the way); *raw "
        "upload* is boto3's `upload_fileobj` (8 MiB parts, 10 threads) of the same tensors "
        "file's bytes. The reads are `Checkpointer.load` (manifest, 16 MiB ranged GETs 4 at a "
        "time into one buffer, sha256 checked, the chunks opened in place when encrypted, arrays "
        "as views of the buffer) and, *raw download*, `download_fileobj` into memory. Peak "
        "memory is the process's peak RSS above what it held before the call (the model itself "
        "is not counted).",
        "",
        "| model | write MB/s: signed / encrypted / raw | time ratio: signed / encrypted "
        "| read MB/s: signed / encrypted / raw | time ratio: signed / encrypted "
        "| peak extra MiB, write: signed / encrypted / raw | peak extra MiB, read: signed / "
        "encrypted / raw |",
        "|---|---|---|---|---|---|---|",
    ]
    for size, row in rows.items():
        lines.append(
            f"| {size / MB:.0f} MB | {row['checkpoint write MB/s']:.0f} / "
            f"{row['encrypted write MB/s']:.0f} / {row['raw upload MB/s']:.0f} | "
            f"{row['write ratio']:.2f}x / {row['encrypted write ratio']:.2f}x | "
            f"{row['checkpoint read MB/s']:.0f} / {row['encrypted read MB/s']:.0f} / "
            f"{row['raw download MB/s']:.0f} | {row['read ratio']:.2f}x / "
            f"{row['encrypted read ratio']:.2f}x | {mib(row['checkpoint write peak'])} / "
            f"{mib(row['encrypted write peak'])} / {mib(row['raw upload peak'])} | "
            f"{mib(row['checkpoint read peak'])} / {mib(row['encrypted read peak'])} / "
            f"{mib(row['raw download peak'])} |"
        )
    lines += [
        "",
        "A time ratio above 1 means the checkpoint took longer than the raw transfer of the same "
        "bytes (median of the per-repeat ratios). What the checkpoint adds: hashing every byte "
        "with sha256 (on both ways), the small state.json, manifest and latest-record objects, "
        "on read the header checks, and, encrypted, AES-256-GCM over every byte (a chunk is "
        "sealed while the previous parts upload, and opened in the buffer it was read into). "
        "The read's peak is the one buffer the tensors live in afterwards (they are views of "
        "it), so a checkpoint of N bytes needs about N bytes to load and little beyond the "
        "model to save. Peaks smaller than the memory the allocator kept from an earlier step "
        "read as 0 (the 10 MB row); the 1 GB row is the telling one: the write holds at most "
        "4 parts in flight plus the one being cut, the read one model-sized buffer.",
        END,
    ]
    return "\n".join(lines)


def main() -> None:
    """Runs the comparison and prints (or writes) the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="10,100,1000", help="model sizes in MB (10^6 bytes)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats per size (default 5)")
    parser.add_argument(
        "--large-repeats", type=int, default=3, help="repeats for sizes of 1 GB and more"
    )
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    rows: dict[int, dict[str, float]] = {}
    repeats: dict[int, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = start_s3(Path(tmp) / "s3")
        try:
            client: Any = server.client()
            client.create_bucket(Bucket=BUCKET)
            for size in (int(float(mb) * MB) for mb in args.sizes.split(",")):
                repeats[size] = args.large_repeats if size >= 1000 * MB else args.repeats
                rows[size] = summarize(measure(client, server.endpoint, size, repeats[size]))
        finally:
            server.stop()
    section = render(rows, repeats)
    print(section)
    if args.write:
        write_section(section, begin=BEGIN, end=END)


if __name__ == "__main__":
    main()
