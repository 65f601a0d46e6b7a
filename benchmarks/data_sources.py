"""Clients' own data: how fast each format is read into the data cache, against the library's
own read of the same file, and what a streamed shard costs against one held in memory.

* **Read**: a client's first start parses its source (``own_data``: list, check against the
  schema, split, write the cache). The floor is the library alone reading the same data into
  one numpy array: pyarrow's ``read_table`` for Parquet and CSV, Pillow decoding each PNG.
* **Stream**: one epoch of local training (an MLP on 784 features) over a shard mapped from
  the cache, held in memory (copied once into a tensor, the default below 1 GiB) or streamed
  (each batch read from the map, ``FEDCORE_RESIDENT_BYTES=0``), each in its own process: the
  epoch's time and the process's private (anonymous) memory at its peak.

``--write`` replaces the data section of docs/benchmarks.md. Sides alternate per repeat;
medians are reported.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from benchmarks.spine import write_section

BEGIN = "<!-- data:begin -->"
END = "<!-- data:end -->"
FEATURES = 30
LABELS = ["malignant", "benign"]


def make_table(rows: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    columns: dict[str, Any] = {f"f{i}": rng.normal(size=rows) for i in range(FEATURES)}
    columns["label"] = pa.array(rng.choice(LABELS, rows).tolist())
    return pa.table(columns)


def make_images(folder: Path, count: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(1)
    for number in range(count):
        label = LABELS[number % 2]
        (folder / label).mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (28, 28), dtype=np.uint8)
        Image.fromarray(pixels, mode="L").save(folder / label / f"{number}.png")


def manifest(data_format: str, path: Path) -> Any:
    from fedcore.spec import parse_manifest

    schema: dict[str, Any] = {"labels": LABELS}
    if data_format == "ImageFolder":
        schema["image"] = {"height": 28, "width": 28}
    else:
        schema["features"] = [{"name": f"f{i}"} for i in range(FEATURES)]
    return parse_manifest(
        {
            "apiVersion": "fedcore.dev/v1alpha1",
            "kind": "FederatedRun",
            "metadata": {"name": "bench"},
            "spec": {
                "protocol": {"name": "fedavg"},
                "data": {
                    "clientData": {
                        "format": data_format,
                        "template": {"path": str(path).replace("site-0", "site-{index}")},
                    },
                    "schema": schema,
                },
                "clients": {"count": 1},
                "rounds": 1,
            },
        }
    )


def read_fedcore(data_format: str, path: Path, cache: Path) -> float:
    """One cold read of the source through ``own_data`` (a fresh cache folder)."""
    from fedcore.learning.data import _own, own_data

    os.environ["FEDCORE_CACHE_DIR"] = str(cache)
    _own._LOADED.clear()
    run = manifest(data_format, path)
    start = time.perf_counter()
    own = own_data(run.spec, 0)
    elapsed = time.perf_counter() - start
    assert len(own.train) + len(own.test) > 0
    _own._LOADED.clear()
    return elapsed


def read_floor(data_format: str, path: Path) -> float:
    """The library alone: the file into one float32 array (features) and the labels."""
    start = time.perf_counter()
    if data_format == "ImageFolder":
        from PIL import Image

        arrays = []
        for file in sorted(path.rglob("*.png")):
            with Image.open(io.BytesIO(file.read_bytes())) as image:
                arrays.append(np.asarray(image, dtype=np.float32) / 255.0)
        np.stack(arrays)
    else:
        file = next(path.iterdir())
        table = pq.read_table(file) if data_format == "Parquet" else pacsv.read_csv(file)
        np.stack([table.column(f"f{i}").to_numpy().astype(np.float32) for i in range(FEATURES)], 1)
        table.column("label").to_pylist()
    return time.perf_counter() - start


TRAIN_SCRIPT = r"""
import json, sys, time
import numpy as np
from fedcore.learning.data import ArrayDataset
from fedcore.learning.models import build_model, get_weights
from fedcore.learning.training import LocalLearner
from fedcore.spec import ModelSpec, OptimizerSpec, TrainingSpec
path, labels = sys.argv[1], sys.argv[2]
x = np.load(path, mmap_mode="r")
y = np.load(labels)
data = ArrayDataset(x, y, 10)
model = build_model(ModelSpec(hidden=[64]), x.shape[1:], 10, seed=0)
training = TrainingSpec(batch_size=256, optimizer=OptimizerSpec(learning_rate=0.05))
learner = LocalLearner(model, data, training, seed=0, client_index=0)
start = time.perf_counter()
learner.train(get_weights(model), round=0)
seconds = time.perf_counter() - start
with open("/proc/self/status") as status:
    fields = dict(line.split(":", 1) for line in status)
anon = int(fields["RssAnon"].split()[0]) * 1024
print(json.dumps({"seconds": seconds, "rss_anon": anon, "streamed": learner.streamed}))
"""


def train_epoch(x_path: Path, y_path: Path, streamed: bool) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["FEDCORE_RESIDENT_BYTES"] = "0" if streamed else str(1 << 40)
    done = subprocess.run(
        [sys.executable, "-c", TRAIN_SCRIPT, str(x_path), str(y_path)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["streamed"] == streamed
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=200_000, help="table rows (default 200k)")
    parser.add_argument("--images", type=int, default=5_000, help="PNG files (default 5,000)")
    parser.add_argument(
        "--shard", type=int, default=300_000, help="examples of the trained shard (784 each)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    reads: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        table = make_table(args.rows)
        sources = {
            "Parquet": root / "parquet" / "site-0",
            "CSV": root / "csv" / "site-0",
            "ImageFolder": root / "images" / "site-0",
        }
        sources["Parquet"].mkdir(parents=True)
        pq.write_table(table, sources["Parquet"] / "data.parquet")
        sources["CSV"].mkdir(parents=True)
        pacsv.write_csv(table, sources["CSV"] / "data.csv")
        make_images(sources["ImageFolder"], args.images)
        for data_format, path in sources.items():
            reads[data_format] = {"fedcore": [], "floor": []}
            for repeat in range(args.repeats):
                reads[data_format]["floor"].append(read_floor(data_format, path))
                cache = root / f"cache-{data_format}-{repeat}"
                reads[data_format]["fedcore"].append(read_fedcore(data_format, path, cache))
            print(data_format, {k: statistics.median(v) for k, v in reads[data_format].items()})
        rng = np.random.default_rng(2)
        x_path, y_path = root / "x.npy", root / "y.npy"
        shard = np.lib.format.open_memmap(
            x_path, mode="w+", dtype=np.float32, shape=(args.shard, 1, 28, 28)
        )
        for start in range(0, args.shard, 50_000):
            stop = min(start + 50_000, args.shard)
            shard[start:stop] = rng.random((stop - start, 1, 28, 28), dtype=np.float32)
        shard.flush()
        del shard
        np.save(y_path, rng.integers(0, 10, args.shard))
        epochs: dict[str, list[dict[str, Any]]] = {"held": [], "streamed": []}
        for _ in range(args.repeats):
            epochs["held"].append(train_epoch(x_path, y_path, streamed=False))
            epochs["streamed"].append(train_epoch(x_path, y_path, streamed=True))
        shard_bytes = x_path.stat().st_size
    lines = [
        BEGIN,
        "## Clients' own data: reading and streaming",
        "",
        f"`python benchmarks/data_sources.py --write` on {dt.date.today()}, "
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"pyarrow {pa.__version__}; medians of {args.repeats} alternating repeats. A client's "
        f"first start reads its source into the data cache (`own_data`: list, check against "
        f"the schema, split, write the cache); the floor is the library alone reading the "
        f"same data into one array. These sources have no held-out part, so fedcore reads "
        f"them twice: a pass that counts the rows (Parquet from its metadata, CSV by parsing "
        f"only the label column, images by listing), then the read that checks each batch and "
        f"routes each row to its split.",
        "",
        "| source | fedcore (cold cache) | floor (library read) | ratio | rows/s (fedcore) |",
        "|---|---|---|---|---|",
    ]
    counts = {"Parquet": args.rows, "CSV": args.rows, "ImageFolder": args.images}
    for data_format, sides in reads.items():
        ours = statistics.median(sides["fedcore"])
        floor = statistics.median(sides["floor"])
        what = {
            "Parquet": f"Parquet, {args.rows:,} rows x {FEATURES} float64 + a string label",
            "CSV": f"CSV, the same table ({args.rows:,} rows)",
            "ImageFolder": f"{args.images:,} PNG files, 28x28 grey",
        }[data_format]
        lines.append(
            f"| {what} | {ours:.2f} s | {floor:.2f} s | {ours / floor:.2f}x | "
            f"{counts[data_format] / ours:,.0f} |"
        )
    held = epochs["held"]
    streamed = epochs["streamed"]
    held_s = statistics.median(e["seconds"] for e in held)
    streamed_s = statistics.median(e["seconds"] for e in streamed)
    held_mem = statistics.median(e["rss_anon"] for e in held)
    streamed_mem = statistics.median(e["rss_anon"] for e in streamed)
    lines += [
        "",
        f"One epoch of local training (MLP 784-64-10, batches of 256, one thread) over a "
        f"{args.shard:,}-example shard ({shard_bytes / 1e9:.2f} GB of float32 features) mapped "
        f"from the cache, held (copied into one tensor first) or streamed (each batch read "
        f"from the map); private memory is the process's RssAnon after the epoch (pages of the "
        f"map are the kernel's page cache, shared and reclaimable, and not in it).",
        "",
        "| shard | epoch | private memory |",
        "|---|---|---|",
        f"| held | {held_s:.1f} s | {held_mem / 1e9:.2f} GB |",
        f"| streamed | {streamed_s:.1f} s ({streamed_s / held_s:.2f}x) | "
        f"{streamed_mem / 1e9:.2f} GB |",
        END,
    ]
    section = "\n".join(lines)
    print(section)
    if args.write:
        write_section(section, begin=BEGIN, end=END)


if __name__ == "__main__":
    main()
