"""Privacy accounting per round: fedcore's accountants against dp-accounting recomposed.

Every round of a DP protocol the server's privacy ledger steps its accountant and reports
epsilon (with a budget, it first asks what one more round would spend, and that answer is the
round's epsilon). The ledger accounts each round without sampling (q = 1: a public sample
claims no amplification, docs/protocols/dp-fedavg.md); the rows with q < 1 measure a
Poisson-sampled mechanism, which the accountants still compute for anyone who asks.

dp-accounting's accountants are append-only objects, so an accountant that must also
answer "what if one more round" and be checkpointed as plain data recomposes its history
into a fresh library accountant: that is what fedcore's accountants did before
(``recomposed`` below). Now the RDP accountant asks the library once per (noise multiplier,
sampling rate) for one round's RDP curve and sums it (RDP composes by addition), and the PLD
accountant builds one sampled round's PLD once and composes it as the library does, or, with
full participation, takes the library's exact epsilon of the one Gaussian the rounds compose
to (``cached``). Every round's epsilon of the two sides is compared: RDP's for equality,
PLD's by the largest relative difference (the discretized and the exact Gaussian agree to
about 1e-9, not to the bit).

The table gives the first round and the median of the others, per side and sampling rate.

``--write`` replaces the accounting section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dp_accounting

from benchmarks.spine import write_section
from fedcore.privacy import Accountant, PldAccountant, RdpAccountant
from fedcore.privacy._accountant import _DpAccountingAccountant

BEGIN = "<!-- accounting:begin -->"
END = "<!-- accounting:end -->"
NOISE = 1.1
DELTA = 1e-5
RATES = (1.0, 0.1, 0.01)


class RecomposedRdp(RdpAccountant):
    """fedcore's RDP accountant as it was: the whole history recomposed by dp-accounting."""

    _epsilon = _DpAccountingAccountant._epsilon


class RecomposedPld(PldAccountant):
    """fedcore's PLD accountant as it was: the whole history recomposed by dp-accounting."""

    _epsilon = _DpAccountingAccountant._epsilon


def run_ledger(accountant: Accountant, rate: float, rounds: int) -> dict[str, Any]:
    """The ledger's calls for ``rounds`` rounds; times per round and the epsilons.

    As ``PrivacyLedger`` does with a budget: the epsilon one more round would reach, then the
    step, whose epsilon is that one (one composition per round).
    """
    times: list[float] = []
    epsilons: list[float] = []
    for _ in range(rounds):
        start = time.perf_counter()
        after = accountant.epsilon_after(DELTA, noise_multiplier=NOISE, sample_rate=rate)
        accountant.step(noise_multiplier=NOISE, sample_rate=rate)
        times.append(time.perf_counter() - start)
        epsilons.append(after)
    return {"first": times[0], "median": statistics.median(times[1:]), "epsilons": epsilons}


def measure(rounds: int, pld_rounds: int) -> list[dict[str, Any]]:
    """Every rate, each side on a fresh accountant; PLD on fewer rounds (it is slow)."""
    rows: list[dict[str, Any]] = []
    for rate in RATES:
        recomposed = run_ledger(RecomposedRdp(), rate, rounds)
        cached = run_ledger(RdpAccountant(), rate, rounds)
        pld_old = run_ledger(RecomposedPld(), rate, pld_rounds)
        pld_new = run_ledger(PldAccountant(), rate, pld_rounds)
        direct = dp_accounting.rdp.RdpAccountant()
        one = dp_accounting.GaussianDpEvent(NOISE)
        direct.compose(dp_accounting.PoissonSampledDpEvent(rate, one) if rate < 1 else one, rounds)
        rows.append(
            {
                "rate": rate,
                "recomposed": recomposed,
                "cached": cached,
                "pld_old": pld_old,
                "pld_new": pld_new,
                "equal": recomposed["epsilons"] == cached["epsilons"],
                "pld_difference": max(
                    abs(new - old) / old
                    for old, new in zip(pld_old["epsilons"], pld_new["epsilons"], strict=True)
                ),
                "library": float(direct.get_epsilon(DELTA)),
            }
        )
        print(
            f"q={rate}: recomposed {recomposed['median'] * 1e3:.3f} ms, cached "
            f"{cached['median'] * 1e3:.3f} ms; PLD recomposed {pld_old['median'] * 1e3:.1f} ms, "
            f"cached {pld_new['median'] * 1e3:.1f} ms per round; "
            f"RDP epsilons equal: {rows[-1]['equal']}, PLD's largest relative difference "
            f"{rows[-1]['pld_difference']:.1e}"
        )
    return rows


def render(rows: list[dict[str, Any]], rounds: int, pld_rounds: int) -> str:
    """The markdown section."""
    import numpy

    def ms(side: dict[str, Any], key: str = "median") -> str:
        value = side[key] * 1e3
        return f"{value:.2f}" if value < 10 else f"{value:.0f}"

    lines = [
        BEGIN,
        "## Privacy accounting per round",
        "",
        f"Measured {dt.date.today().isoformat()} by `python benchmarks/accounting.py --write` "
        f"on {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"dp-accounting {_version('dp-accounting')}, numpy {numpy.__version__}.",
        "",
        "An accountant called as the server's privacy ledger calls it every round of a DP "
        f"protocol with a budget (`epsilon_after` at delta {DELTA:g}, then `step`), noise "
        f"multiplier {NOISE}, sampling rate q, {rounds} rounds with RDP and {pld_rounds} with "
        "PLD. The ledger itself accounts every round at q = 1 (a public sample claims no "
        "amplification, docs/protocols/dp-fedavg.md), so the q = 1 row is what a run pays; "
        "the q < 1 rows are a Poisson-sampled mechanism's cost. *Recomposed* is "
        "fedcore's accountants before 2026-11-22: every epsilon composed the whole history "
        "afresh in a new dp-accounting accountant. *Cached* is the accountants now: RDP sums "
        "one round's RDP curve (from dp-accounting, once per noise multiplier and rate) over "
        "the history, then converts with dp-accounting; PLD builds one sampled round's PLD "
        "once and self-composes it as dp-accounting does, and with q = 1 asks dp-accounting "
        "for the exact epsilon of the single Gaussian mechanism the rounds compose to (noise "
        "1 / sqrt(sum(n / z^2))), where the library builds and converts a discretized PLD of "
        "that Gaussian, whose support grows with the rounds.",
        "",
        "| q | RDP recomposed (ms) | RDP cached (ms) | ratio | RDP cached, first round (ms) "
        "| PLD recomposed (ms) | PLD cached (ms) | ratio | RDP epsilons equal "
        f"| PLD epsilons, largest relative difference | epsilon after {rounds} rounds (RDP) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        old, new = row["recomposed"], row["cached"]
        pld_old, pld_new = row["pld_old"], row["pld_new"]
        lines.append(
            f"| {row['rate']:g} | {ms(old)} | {ms(new)} | "
            f"{_ratio(old['median'] / new['median'])} | {ms(new, 'first')} | {ms(pld_old)} | "
            f"{ms(pld_new)} | {_ratio(pld_old['median'] / pld_new['median'])} | "
            f"{'yes' if row['equal'] else '**no**'} | {row['pld_difference']:.1e} | "
            f"{new['epsilons'][-1]:.4g} (dp-accounting alone: {row['library']:.4g}) |"
        )
    lines += [
        "",
        "Times are per round (medians after the first), on the server's critical path "
        "between two rounds. RDP epsilons equal means every round's epsilon of the recomposed "
        "and the cached side is the same float; for PLD the largest relative difference over "
        "the rounds is given: 0 where both sides compose the same discretized PLDs (q < 1), "
        "and the discretization's error where the cached side is the exact Gaussian (q = 1). "
        "tests/unit/test_accountant.py holds RDP and sampled PLD to dp-accounting's own "
        "composition bit for bit, and full-participation PLD to dp-accounting's exact "
        "Gaussian epsilon bit for bit and to its discretized composition to 1e-8. With "
        "sampling (q < 1) dp-accounting evaluates the sampled Gaussian's RDP at each order by "
        "series, and builds a sampled round's PLD by discretizing a "
        "mixture: a recomposition paid that every round, the cached accountants pay it once, "
        "in the first round. With sampling PLD stays far slower than RDP per round (its "
        "composition and conversion work on discretized distributions); RDP is the default.",
        END,
    ]
    return "\n".join(lines)


def _ratio(value: float) -> str:
    return f"{value:.1f}x" if value < 10 else f"{value:.0f}x"


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def _at_least_two(text: str) -> int:
    """A round count: the first round is reported apart, so the median needs one more."""
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"needs at least 2 rounds, got {value}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rounds", type=_at_least_two, default=100, help="rounds per side (default 100)"
    )
    parser.add_argument(
        "--pld-rounds", type=_at_least_two, default=10, help="PLD rounds (default 10)"
    )
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    rows = measure(args.rounds, args.pld_rounds)
    section = render(rows, args.rounds, args.pld_rounds)
    if args.write:
        write_section(section, begin=BEGIN, end=END)
    else:
        print(section)


if __name__ == "__main__":
    main()
