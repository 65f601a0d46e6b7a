"""Byzantine clients for robustness experiments (``spec.attack``): who attacks, and how.

An experiment knob, never a production feature: the attacking clients apply the attack to
themselves (a label flip to their own shard, a sign flip or scaling to their own update, noise
to their own encoded upload), so the defences under test see exactly what a real attacker
would send. The attackers are round(fraction * count) clients drawn by ``spec.attack.seed``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedcore.spec import FederatedRunSpec
from fedcore.transport import Payload

_ATTACKER_TAG = 0xA77AC4
"""Separates the attacker draw from every other use of the attack's seed."""


def attackers(spec: FederatedRunSpec) -> frozenset[int]:
    """The indices of the attacking clients (empty without ``spec.attack``)."""
    attack = spec.attack
    if attack is None:
        return frozenset()
    count = spec.clients.count
    chosen = round(attack.fraction * count)
    rng = np.random.default_rng([attack.seed, _ATTACKER_TAG])
    return frozenset(int(k) for k in rng.choice(count, size=chosen, replace=False))


def attack_of(spec: FederatedRunSpec, index: int) -> str | None:
    """The kind of attack client ``index`` runs, or None for an honest client."""
    if spec.attack is None or index not in attackers(spec):
        return None
    return spec.attack.kind


def flip_labels(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """LabelFlip: y -> num_classes - 1 - y."""
    return (num_classes - 1 - labels).astype(labels.dtype)


def poison_update(update: np.ndarray, kind: str | None, scale: float) -> np.ndarray:
    """SignFlip: -scale * update; Scale: scale * update; any other kind: unchanged."""
    if kind == "SignFlip":
        return -scale * update
    if kind == "Scale":
        return scale * update
    return update


def overflow_upload(upload: Payload) -> Payload:
    """Overflow: every floating-point tensor of an upload at its dtype's largest finite value
    (finite, so only a bound on the upload, not a finiteness check, refuses it). Any protocol's
    client runtime applies it to its own upload (``spec.attack.kind`` Overflow)."""
    tensors = {
        name: np.full_like(value, np.finfo(value.dtype).max)
        if np.issubdtype(value.dtype, np.floating)
        else value
        for name, value in upload.tensors.items()
    }
    return Payload(meta=dict(upload.meta), tensors=tensors)


def tamper(upload: np.ndarray, scale: float, seed: int, round: int, client: int) -> np.ndarray:
    """MalformedEncoding: adds Gaussian noise of norm scale * ||upload|| to an encoded upload."""
    rng = np.random.default_rng([seed, _ATTACKER_TAG, round, client])
    noise = rng.standard_normal(upload.shape)
    noise *= scale * float(np.linalg.norm(upload)) / max(float(np.linalg.norm(noise)), 1e-300)
    return upload + noise


def misreport_evaluation(answer: dict[str, Any]) -> dict[str, Any]:
    """MisreportEvaluation: an evaluation answer claiming one more example right than were
    scored (the server must refuse it). The client runtime applies it to its own answer
    (``spec.attack.kind`` MisreportEvaluation)."""
    counts = dict(answer["evaluation"])
    counts["correct"] = int(counts["total"]) + 1
    return {**answer, "evaluation": counts}
