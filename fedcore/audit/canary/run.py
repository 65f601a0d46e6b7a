"""``run_canary_audit``: one simulated run with canary clients, and the ε it shows.

The design is Andrew et al.'s ("One-shot Empirical Privacy Estimation for Federated
Learning", ICLR 2024): ``m`` canaries, each a client whose update is a fixed random unit
direction; each is inserted with probability 1/2 (Steinke, Nasr and Jagielski's one-run
design, so both estimators read the same run), the others held out. After the run, each
canary's score is the cosine between the final model's movement and its direction. The
inserted and held-out scores give:

* the one-shot estimate: the ε at which Gaussians fitted to the two groups are (ε, δ)-close,
  with a bootstrap interval (an estimate, not a bound);
* the one-run lower bound: the ε that the auditor's guesses of who was inserted refute at the
  stated confidence (a bound: a correct (ε, δ)-DP run stays below it at that confidence).

The run is the manifest's with the inserted canaries appended as extra clients, sampled at
the manifest's rate (``perRound`` as a count is scaled to keep it), and the claimed ε is that
run's own accountant's. A secret sample is audited as the seeded one, as every audit does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedcore.audit._seeded import audited
from fedcore.audit.canary.estimate import (
    OneRunBound,
    OneShotEstimate,
    one_run_lower_bound,
    one_shot_estimate,
)
from fedcore.learning.canary import CanaryClients, along, random_direction, trainable_shapes
from fedcore.learning.data import client_dataset, dataset_info, shard_sizes
from fedcore.learning.models import build_model, get_weights
from fedcore.learning.training import LocalLearner
from fedcore.simulation import simulate
from fedcore.spec import FederatedRun, FederatedRunSpec, protocol_facts

DEFAULT_CANARIES = 200
"""Canaries per audit by default: a one-run bound from 200 cannot pass about 4 (see
``CanaryAudit.ceiling``); more canaries raise that ceiling and cost one client each."""

MAX_DIRECTION_BYTES = 2 << 30
"""The canaries' directions are held in memory (float64): refuse more than 2 GiB of them."""

GRADIENT_PROTOCOLS = frozenset({"fedsgd", "adaptive", "mpdp"})
"""Protocols whose clients send a gradient (a canary's honest scale is a gradient's norm)."""

UNSUPPORTED = {
    "perturb": "its clients upload closed-form terms of their data, which no canary can set",
    "lppa": "it is decentralized: no one model that every client moves",
}
"""Protocols a canary cannot probe, and why."""


@dataclass
class CanaryAudit:
    """What the canaries showed.

    Attributes:
        canaries: m, the canaries drawn.
        inserted: how many of them took part in the run (each with probability 1/2).
        scale: the L2 norm of each canary's update.
        scale_from: where that norm came from (the protocol's clipping bound, or an honest
            client's update).
        clients: the run's own clients (the canaries came after them).
        per_round: the clients sampled per round in the audited run.
        rounds: the rounds the run completed.
        delta: the δ of every ε here (the run's targetDelta).
        claimed: the run's accountant's ε (None: the protocol claims no DP here).
        claim: what the claimed ε bounds (the ledger's claim).
        estimate: the one-shot estimate (Andrew et al.).
        bound: the one-run lower bound (Steinke, Nasr and Jagielski).
        ceiling: the largest lower bound this many canaries can show (all guesses right).
        inserted_scores: the inserted canaries' cosines.
        held_out_scores: the held-out canaries' cosines.
        accuracy: the audited run's held-out accuracy.
    """

    canaries: int
    inserted: int
    scale: float
    scale_from: str
    clients: int
    per_round: int
    rounds: int
    delta: float
    claimed: float | None
    claim: dict[str, str] | None
    estimate: OneShotEstimate
    bound: OneRunBound
    ceiling: float
    inserted_scores: np.ndarray = field(repr=False)
    held_out_scores: np.ndarray = field(repr=False)
    accuracy: float = float("nan")

    @property
    def verdict(self) -> str:
        """What the canaries say of the claim, the strongest first:

        * ``exceeds claim``: the one-run lower bound passes the claimed ε (the run leaks more
          than it claims, at the stated confidence);
        * ``estimate above claim``: the one-shot estimate's whole interval lies above the
          claimed ε (an estimate, not a proof: beyond what this many canaries can bound);
        * ``consistent``; or ``no DP claim``.
        """
        if self.claimed is None:
            return "no DP claim"
        if self.bound.epsilon > self.claimed:
            return "exceeds claim"
        if self.estimate.low > self.claimed:
            return "estimate above claim"
        return "consistent"

    def as_json(self) -> dict[str, Any]:
        """The audit as a JSON-able dict (without the scores)."""
        return {
            "canaries": self.canaries,
            "inserted": self.inserted,
            "scale": self.scale,
            "scale_from": self.scale_from,
            "clients": self.clients,
            "per_round": self.per_round,
            "rounds": self.rounds,
            "delta": self.delta,
            "claimed_epsilon": self.claimed,
            "claim": self.claim,
            "verdict": self.verdict,
            "one_shot": {
                "epsilon": self.estimate.epsilon,
                "low": self.estimate.low,
                "high": self.estimate.high,
                "confidence": self.estimate.confidence,
            },
            "one_run": {
                "epsilon": self.bound.epsilon,
                "confidence": self.bound.confidence,
                "guesses": self.bound.guesses,
                "correct": self.bound.correct,
                "ceiling": self.ceiling,
            },
            "inserted_mean": float(np.mean(self.inserted_scores)),
            "held_out_mean": float(np.mean(self.held_out_scores)),
            "accuracy": self.accuracy,
        }


def check_canaries(spec: FederatedRunSpec, canaries: int) -> None:
    """Refuses what a canary audit cannot run, naming why.

    Raises:
        ValueError: a protocol no canary can probe, or fewer than 4 canaries.
    """
    name = spec.protocol.name
    if name in UNSUPPORTED:
        raise ValueError(f"The canary audit cannot probe {name}: {UNSUPPORTED[name]}.")
    if canaries < 4:
        raise ValueError(f"--canaries needs at least 4 canaries, got {canaries}.")


def clipping_bound(spec: FederatedRunSpec) -> float | None:
    """The L2 bound the protocol puts on one client's contribution, if it has one."""
    protocol = spec.protocol
    if protocol.name == "dp-fedavg":
        return float(protocol.dp_fedavg.clipping_norm)
    if protocol.name == "mpdp" and protocol.mpdp.client_noise_std > 0:
        return float(protocol.mpdp.clipping_norm)
    secagg = protocol.secagg if protocol.name == "secagg" else None
    if secagg is not None and secagg.distributed_dp is not None:
        return float(secagg.distributed_dp.clipping_norm)
    if protocol.name == "adaptive" and protocol.adaptive.measure == "DP":
        return float(protocol.adaptive.dp.clipping_norm)
    return None


def client_level_claim(
    spec: FederatedRunSpec, rounds: int, examples: int
) -> tuple[float, dict[str, str]] | None:
    """adaptive's formal DP (measure DP, strategy Identical) as a claim about a whole client,
    which is what a canary is; None for any other protocol or mode.

    adaptive's epsilon is per example of one round's batch: its Laplace noise is calibrated to
    the L1 sensitivity 2 eta C sqrt(P) / B of replacing one of the B clipped gradients in the
    batch mean. Replacing the whole client moves that mean by up to 2C, B times as much, so
    one round's upload is (B epsilon)-DP for the client, and ``rounds`` rounds (a client
    takes part once a round at most) are (rounds B epsilon, 0)-DP by basic composition. B is
    the batch a canary with ``examples`` rows draws (its private rows, capped at the batch
    size), as adaptive's client computes it.
    """
    options = spec.protocol.adaptive
    if spec.protocol.name != "adaptive" or options.measure != "DP":
        return None
    if options.strategy != "Identical":
        return None  # a learned distortion is not calibrated noise: no formal claim
    private = examples - round(options.held_out_fraction * examples)
    batch = max(1, min(spec.training.batch_size, private))
    claim = {
        "adjacency": "a whole client (its batch of B examples: B times the per-example epsilon)",
        "composition": "basic, over the rounds (pure DP)",
        "batch": str(batch),
    }
    return rounds * batch * options.dp.epsilon, claim


def honest_norm(spec: FederatedRunSpec) -> float:
    """The L2 norm of client 0's first update from the initial model (a gradient's, for
    protocols that send gradients): the canaries' scale where no clipping bound sets it."""
    shape, classes = dataset_info(spec)
    model = build_model(spec.model, shape, classes, seed=spec.seed)
    start = get_weights(model)
    data = client_dataset(spec, 0)
    learner = LocalLearner(model, data, spec.training, seed=spec.seed, client_index=0)
    if spec.protocol.name in GRADIENT_PROTOCOLS:
        moved, _ = learner.gradient(start, round=1)
        step = {name: np.asarray(g, np.float64) for name, g in moved.items()}
    else:
        trained, _ = learner.train(start, round=1)
        step = {n: np.asarray(trained[n], np.float64) - start[n] for n in trained}
    shapes = trainable_shapes(model)
    return float(np.sqrt(sum(float(np.sum(step[n] ** 2)) for n in shapes)))


def with_canaries(run: FederatedRun, inserted: int) -> FederatedRun:
    """``run`` with ``inserted`` more clients, sampled at the same rate."""
    clients = run.spec.clients
    count = clients.count + inserted
    per_round: int | str = clients.per_round
    if isinstance(per_round, int):
        per_round = min(count, max(1, round(per_round * count / clients.count)))
    grown = clients.model_copy(update={"count": count, "per_round": per_round})
    return run.model_copy(update={"spec": run.spec.model_copy(update={"clients": grown})})


def run_canary_audit(
    run: FederatedRun,
    *,
    canaries: int = DEFAULT_CANARIES,
    seed: int = 0,
    rounds: int | None = None,
    confidence: float = 0.95,
) -> CanaryAudit:
    """Simulates ``run`` with canaries inserted and estimates the ε the final model shows.

    Args:
        run: the manifest (its secret sample audited as the seeded one).
        canaries: m, the canaries drawn (about half inserted).
        seed: the canaries' directions and which are inserted.
        rounds: simulate only the first ``rounds`` rounds (None: ``spec.rounds``).
        confidence: the one-run bound's confidence and the estimate's interval.

    Raises:
        ValueError: a protocol no canary can probe, too few canaries, or directions that
            would not fit in memory.
    """
    check_canaries(run.spec, canaries)
    run = audited(run)
    spec = run.spec
    shape, classes = dataset_info(spec)
    model = build_model(spec.model, shape, classes, seed=spec.seed)
    initial = get_weights(model)
    shapes = trainable_shapes(model)
    size = sum(math.prod(s) for s in shapes.values())
    if canaries * size * 8 > MAX_DIRECTION_BYTES:
        raise ValueError(
            f"{canaries} canaries of {size:,} parameters need {canaries * size * 8 / 2**30:.1f} "
            f"GiB of directions (at most {MAX_DIRECTION_BYTES / 2**30:.0f}): use fewer canaries."
        )
    rng = np.random.default_rng([seed, 0x1A5E])
    chosen = rng.random(canaries) < 0.5
    directions = [random_direction(shapes, seed, i) for i in range(canaries)]
    bound_by_protocol = clipping_bound(spec)
    scale = bound_by_protocol if bound_by_protocol is not None else honest_norm(spec)
    scale_from = (
        "the protocol's clipping bound"
        if bound_by_protocol is not None
        else "client 0's first update (the protocol bounds no update)"
    )
    sizes = shard_sizes(spec)
    examples = int(np.median(sizes)) if sizes else 1
    audited_run = with_canaries(run, int(chosen.sum()))
    probes = CanaryClients(
        first=spec.clients.count,
        directions=tuple(d for d, keep in zip(directions, chosen, strict=True) if keep),
        scale=scale,
        examples=max(1, examples),
    )
    result = simulate(audited_run, rounds=rounds, canaries=probes)
    movement = along(result.weights, directions[0]) - along(initial, directions[0])
    norm = float(np.linalg.norm(movement))
    scores = np.array(  # each direction has norm 1
        [float(along(d, d) @ movement) / norm if norm > 0 else 0.0 for d in directions]
    )
    ledger_delta = spec.privacy.target_delta if spec.privacy is not None else 1e-5
    claims = protocol_facts(spec.protocol.name).claims_dp and result.epsilon is not None
    claimed, claim = (result.epsilon, result.epsilon_claim) if claims else (None, None)
    client_level = client_level_claim(spec, result.rounds_completed, max(1, examples))
    if client_level is not None:
        claimed, claim = client_level
    estimate = one_shot_estimate(
        scores[chosen], scores[~chosen], ledger_delta, confidence=confidence, seed=seed
    )
    bound = one_run_lower_bound(scores, chosen, ledger_delta, confidence=confidence)
    perfect = np.where(chosen, 1.0, -1.0)  # every guess right: what m canaries can show
    ceiling = one_run_lower_bound(perfect, chosen, ledger_delta, confidence=confidence).epsilon
    return CanaryAudit(
        canaries=canaries,
        inserted=int(chosen.sum()),
        scale=scale,
        scale_from=scale_from,
        clients=spec.clients.count,
        per_round=audited_run.spec.clients.sampled_per_round(),
        rounds=result.rounds_completed,
        delta=ledger_delta,
        claimed=claimed,
        claim=claim,
        estimate=estimate,
        bound=bound,
        ceiling=ceiling,
        inserted_scores=scores[chosen],
        held_out_scores=scores[~chosen],
        accuracy=result.accuracy,
    )
