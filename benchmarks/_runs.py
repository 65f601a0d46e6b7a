"""Helpers of the protocol benchmarks: a resumable cache of finished jobs, timed ``fedcore run``
jobs over real processes read back from their events, and their medians over alternating
repeats."""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from benchmarks.spine import run_measured


class Cache:
    """Finished jobs by key, in a JSON file (None: in memory), so a stopped run resumes."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.data: dict[str, Any] = {}
        if path is not None and path.exists():
            self.data = json.loads(path.read_text(encoding="utf-8"))

    def get(self, key: str, compute: Callable[[], Any]) -> Any:
        """Returns the cached value of ``key``, computing (and saving) it if missing."""
        if key not in self.data:
            self.data[key] = compute()
            if self.path is not None:
                self.path.write_text(json.dumps(self.data, indent=1), encoding="utf-8")
        return self.data[key]


def timed_run(document: dict[str, Any], folder: Path, name: str) -> dict[str, Any]:
    """Runs ``document`` with ``fedcore run`` (a server and one process per client).

    Returns:
        ``median_round`` (seconds), ``server_bytes`` (the server's bytes per round, both
        directions), ``peer_bytes`` (the median over rounds after the first of the clients'
        reported ``peer_bytes_sent``, summed over clients; 0 for central protocols),
        ``accuracy`` and ``wall`` (seconds).
    """
    rounds = int(document["spec"]["rounds"])
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    work = folder / name
    command = [sys.executable, "-m", "fedcore", "run", str(path), "--json", "--quiet"]
    result, wall, _, _ = run_measured([*command, "--workdir", str(work)])
    events = [json.loads(line) for line in (work / "events.jsonl").read_text().splitlines()]
    sent = [
        float(e["metrics"]["peer_bytes_sent"])
        for e in events
        if e["event"] == "round" and "peer_bytes_sent" in (e.get("metrics") or {})
    ]
    server = (result["server_bytes_sent"] or 0) + (result["server_bytes_received"] or 0)
    return {
        "median_round": result["median_round_seconds"],
        "server_bytes": server / rounds,
        "peer_bytes": statistics.median(sent[1:]) if len(sent) > 1 else 0.0,
        "accuracy": result["accuracy"],
        "wall": wall,
    }


def timed_medians(
    documents: dict[tuple[str, int], dict[str, Any]], repeats: int, cache: Cache, baseline: str
) -> list[dict[str, Any]]:
    """Runs every document once per repeat, in turn (so the arms alternate), ``repeats`` times.

    Args:
        documents: the manifests by (arm, client count).
        baseline: the arm the round times are divided by, at the same client count.

    Returns:
        Per (arm, count), in the order given: medians over repeats of what :func:`timed_run`
        returns, and ``ratio``, the median round time over the baseline's.
    """
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {key: [] for key in documents}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            for (arm, count), document in documents.items():
                name = f"{arm.replace(' ', '-')}-{count}-{repeat}"
                rounds = document["spec"]["rounds"]
                measured = cache.get(
                    f"timing|{name}|{rounds}",
                    functools.partial(timed_run, document, Path(tmp), name),
                )
                runs[(arm, count)].append(measured)
                print(f"timed {name}: {measured['median_round'] * 1000:.0f} ms", file=sys.stderr)
    rows = [
        {
            "arm": arm,
            "count": count,
            **{
                key: statistics.median(m[key] for m in measured)
                for key in ("median_round", "server_bytes", "peer_bytes", "accuracy")
            },
        }
        for (arm, count), measured in runs.items()
    ]
    for row in rows:
        base = next(r for r in rows if r["count"] == row["count"] and r["arm"] == baseline)
        row["ratio"] = row["median_round"] / base["median_round"]
    return rows


def add_common_arguments(parser: argparse.ArgumentParser, sources: tuple[str, ...]) -> None:
    """The options both protocol benchmarks take: --repeats, --sources, --write, --cache."""
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per arm (default 2)")
    parser.add_argument(
        "--sources",
        nargs="+",
        default=list(sources),
        choices=sources,
        help="data sources of the accuracy jobs (default all)",
    )
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument(
        "--cache", type=Path, default=None, help="a JSON file of finished jobs (to resume)"
    )
