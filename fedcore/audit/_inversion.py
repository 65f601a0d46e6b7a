"""Reconstruction attacks: gradient inversion by the server, model differencing by a client.

* ``dlg`` and ``inverting-gradients`` (server): invert each attacked upload at the model the
  server broadcast (a multi-stage protocol's upload: the response its view names, secagg's
  masked input).
* ``differencing-inversion`` (client): from two consecutive broadcast models, remove its own
  known contribution and invert what is left: the other participants' update (plaintext
  protocols only; the broadcasts must be the true models).
* ``differencing-subspace`` (client; digest 001 §7b S3): the first layer of a bias-free ReLU
  MLP is updated by combinations of the inputs, and the perturbation protocols only rescale
  its rows, so every changed row of two consecutive broadcasts spans a plane that holds the
  step's inputs; with the attacker's own inputs projected out, the planes' intersection is the
  others' input (exact for a one-example update, whatever the fresh noise).
* ``correction-leak`` (server; digest 000 G6): mpdp's Faithful uploads carry Phi and Psi in
  the clear; for one example their first-layer rows are multiples of the input.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
from scipy.optimize import linprog

from fedcore.audit import _figures
from fedcore.audit._attack import Attack, AttackResult, AuditContext
from fedcore.audit._reconstruct import Bounds, Scores, invert, scale_direction
from fedcore.transport import Payload


def _finish(
    attack: Attack,
    ctx: AuditContext,
    scores: Scores,
    bounds: Bounds,
    details: Mapping[str, object],
    *,
    tag: int,
) -> AttackResult:
    """Turns pooled scores into a result with its figure."""
    if not scores.psnr:
        why = str(details.get("why", "nothing to attack"))
        return attack.result(skipped=why, details=dict(details))
    estimates = scores.estimates(ctx.rng(tag))
    figure = f"{attack.name}.png"
    _figures.reconstructions(
        ctx.figures / figure,
        scores.pairs,
        bounds.shape,
        f"{attack.title}: {ctx.spec.protocol.name}",
        low=bounds.low,
        high=bounds.high,
    )
    return attack.result(
        verdict=estimates[0],
        estimates=estimates,
        details=dict(details),
        figures=[str(Path(ctx.figures.name) / figure)],
    )


def received(ctx: AuditContext, round_: int) -> dict[int, Payload]:
    """What the server received of each client's update in ``round_``: the upload, or for a
    multi-stage protocol the response of its view's ``received_stage`` (secagg: the masked
    input), for the clients that sent one."""
    rec, stage = ctx.recording, ctx.view.received_stage
    if stage is None:
        return dict(rec.uploads.get(round_, {}))
    return {
        client: response
        for (number, client), (_, response) in sorted(rec.stages.get(round_, {}).items())
        if number == stage and client in rec.instructions.get(round_, {})
    }


def _victims(ctx: AuditContext) -> list[tuple[int, int]]:
    """(round, client) uploads the server attacks: the first and last kept rounds, the first
    ``budget.victims`` uploads of each (by client index)."""
    rounds = sorted(ctx.recording.uploads)
    chosen = sorted({rounds[0], rounds[-1]}) if rounds else []
    return [
        (round_, client)
        for round_ in chosen
        for client in sorted(received(ctx, round_))[: ctx.budget.victims]
    ]


class GradientInversion(Attack):
    """DLG or inverting gradients on the uploads the server receives."""

    view = "server"

    def __init__(self, method: str) -> None:
        self.method = method
        if method == "dlg":
            self.name, self.title = "dlg", "Gradient inversion, DLG"
            self.assumes = (
                "The server inverts each attacked upload at the model it broadcast: dummy "
                "inputs and soft labels optimised by L-BFGS until their gradient matches the "
                "upload in L2 (Zhu et al. 2019). It knows the architecture, the loss, the "
                "upload's example count and the data range; its blind guess is the mean of "
                "the held-out data it holds. Only uploads that are a gradient at the broadcast "
                "model are attacked."
            )
        else:
            self.name, self.title = "inverting-gradients", "Gradient inversion, inverting gradients"
            self.assumes = (
                "As DLG, but matching the upload's direction (cosine distance) with a "
                "total-variation prior and box constraints, by Adam (Geiping et al. 2020); a "
                "model update after local training is matched as if it were one gradient."
            )

    def run(self, ctx: AuditContext) -> AttackResult:
        rec = ctx.recording
        bounds = Bounds.of(ctx.test().x)
        scores = Scores.empty()
        attacked: list[dict[str, object]] = []
        why = "no upload was recorded"
        rng = ctx.rng(11 if self.method == "dlg" else 12)
        for round_, client in _victims(ctx):
            upload = received(ctx, round_)[client]
            instruction = rec.instructions[round_][client]
            observed = ctx.view.server_gradient(instruction, upload)
            if observed is None:
                why = "the protocol's uploads are not gradients of the broadcast model"
                continue
            gradient, kind = observed
            if kind != "gradient" and self.method == "dlg":
                why = "the uploads are trained models, not gradients (see inverting-gradients)"
                continue
            shard = ctx.shard(client)
            rows = ctx.view.upload_rows(round_, client, len(shard))
            shard = shard if rows is None else shard.subset(rows)
            batch = len(shard)
            if batch > ctx.budget.max_batch:
                why = f"every attacked upload holds more than {ctx.budget.max_batch} examples"
                continue
            iterations = (
                ctx.budget.dlg_iterations if self.method == "dlg" else ctx.budget.ig_iterations
            )
            recon = invert(
                ctx.view.broadcast(instruction),
                gradient,
                batch=batch,
                num_classes=ctx.view.num_classes,
                bounds=bounds,
                method=self.method,
                iterations=iterations,
                rng=rng,
                restarts=ctx.budget.restarts if self.method == "dlg" and batch <= 8 else 1,
            )
            scores.add(recon, shard.x, bounds)
            attacked.append({"round": round_, "client": client, "examples": batch, "kind": kind})
        details = {"uploads": attacked, "why": why}
        return _finish(self, ctx, scores, bounds, details, tag=21 if self.method == "dlg" else 22)


def _pairs(ctx: AuditContext) -> list[tuple[int, int]]:
    """Consecutive kept rounds (t, t+1) in both of which the attacker took part."""
    rec, attacker = ctx.recording, ctx.attacker
    return [
        (t, t + 1)
        for t in sorted(rec.instructions)
        if t + 1 in rec.instructions
        and attacker in rec.instructions[t]
        and attacker in rec.instructions[t + 1]
        and attacker in rec.uploads.get(t, {})
    ]


def _others(ctx: AuditContext, round_: int) -> list[int]:
    """The participants of ``round_`` other than the attacker."""
    return [k for k in ctx.recording.participants[round_] if k != ctx.attacker]


class DifferencingInversion(Attack):
    """A client inverts the others' part of the released update between two broadcasts."""

    name = "differencing-inversion"
    title = "Model differencing + inversion"
    view = "client"
    assumes = (
        "A participating client keeps two consecutive broadcast models, subtracts its own "
        "contribution (it knows its upload, the weighting and, for dp-fedavg, the clipping "
        "norm and m; the other participants' shard sizes are assumed known) and inverts the "
        "rest, the other participants' summed update plus any noise, with inverting gradients "
        "at the earlier model. Its blind guess is the mean of its own shard."
    )

    def run(self, ctx: AuditContext) -> AttackResult:
        rec = ctx.recording
        bounds = Bounds.of(ctx.shard(ctx.attacker).x)
        scores = Scores.empty()
        attacked: list[dict[str, object]] = []
        why = "no two consecutive recorded rounds with the attacker in both"
        rng = ctx.rng(13)
        for t, t1 in _pairs(ctx):
            others = _others(ctx, t)
            sizes = {k: len(ctx.shard(k)) for k in rec.participants[t]}
            update = ctx.view.others_update(
                rec.instructions[t][ctx.attacker],
                rec.instructions[t1][ctx.attacker],
                rec.uploads[t][ctx.attacker],
                sizes,
                ctx.attacker,
            )
            if update is None:
                why = "the broadcasts are not the true models (see differencing-subspace)"
                break
            if not others:
                why = "the attacker was the only participant"
                continue
            targets = np.concatenate([ctx.shard(k).x for k in others])
            if len(targets) > ctx.budget.max_batch:
                why = f"every update spans more than {ctx.budget.max_batch} examples"
                continue
            recon = invert(
                ctx.view.broadcast(rec.instructions[t][ctx.attacker]),
                update,
                batch=len(targets),
                num_classes=ctx.view.num_classes,
                bounds=bounds,
                method="inverting-gradients",
                iterations=ctx.budget.ig_iterations,
                rng=rng,
            )
            scores.add(recon, targets, bounds)
            attacked.append({"rounds": [t, t1], "others": others, "examples": len(targets)})
        return _finish(self, ctx, scores, bounds, {"pairs": attacked, "why": why}, tag=23)


def plane_intersection(
    before: np.ndarray, after: np.ndarray, own: np.ndarray, *, tolerance: float = 1e-9
) -> tuple[np.ndarray, int]:
    """The others' input behind a first-layer step, from two broadcasts' first layers.

    Each changed row i of a bias-free first layer moves by a combination of the step's
    inputs, so span(before_i, after_i) holds it; once the attacker's own inputs ``own`` are
    projected out, every row's projected plane holds the others' input (projected), so for a
    one-example others' step the top eigenvector of the sum of the planes' projectors is that
    input's component orthogonal to ``own``. The attacker's inputs are then added back as
    little as nonnegative data allow (the least total mass, a linear program): where the
    victim's pixel is zero and the attacker's is not, that fixes the amount exactly.

    Returns:
        The recovered direction (up to scale) and the number of rows used.
    """
    d = before.shape[1]
    own_flat = own.reshape(len(own), -1).astype(np.float64)
    basis = _orthonormal(own_flat.T)
    complement = np.eye(d) - basis @ basis.T
    total = np.zeros((d, d))
    used = 0
    for b, a in zip(before, after, strict=True):
        nb, na = np.linalg.norm(b), np.linalg.norm(a)
        if nb == 0 or na == 0 or abs(float(b @ a)) / (nb * na) > 1 - tolerance:
            continue  # an unchanged (dead) neuron's row spans no plane
        plane = _orthonormal(complement @ np.stack([b / nb, a / na], axis=1))
        if plane.shape[1] == 2:
            total += plane @ plane.T
            used += 1
    _, vectors = np.linalg.eigh(total)
    direction = vectors[:, -1]
    if not len(own_flat) or used == 0:
        return direction, used
    return _add_back_own(direction, own_flat), used


def _orthonormal(columns: np.ndarray) -> np.ndarray:
    """An orthonormal basis of the span of ``columns`` (numerically nonzero directions)."""
    if columns.size == 0:
        return np.zeros((columns.shape[0], 0))
    u, singular, _ = np.linalg.svd(columns, full_matrices=False)
    if not singular.size or singular.max() == 0:
        return np.zeros((columns.shape[0], 0))
    return u[:, singular > singular.max() * 1e-8]


def _add_back_own(direction: np.ndarray, own: np.ndarray) -> np.ndarray:
    """Of ``+-direction + own.T @ beta >= 0``, the sign and beta of least total mass."""
    best: tuple[float, np.ndarray] | None = None
    for sign in (1.0, -1.0):
        e = sign * direction
        outcome = linprog(
            c=own.sum(axis=1),
            A_ub=-own.T,
            b_ub=e,
            bounds=[(None, None)] * len(own),
            method="highs",
        )
        if outcome.status == 0:
            candidate = e + own.T @ outcome.x
            shortfall = 0.0
        else:  # infeasible: the wrong sign; keep it only if neither sign fits
            candidate = np.clip(e, 0, None)
            shortfall = float(np.sum(np.minimum(e, 0) ** 2)) + 1.0
        if best is None or shortfall < best[0]:
            best = (shortfall, candidate)
    assert best is not None
    return best[1]


class DifferencingSubspace(Attack):
    """Digest 001 §7b S3: intersect the first-layer row planes of two broadcasts."""

    name = "differencing-subspace"
    title = "Model differencing, first-layer planes"
    view = "client"
    assumes = (
        "A participating client keeps the first layer of two consecutive broadcasts (true or "
        "row-rescaled by positive secrets, as perturb and mpdp send them). Each changed row "
        "spans a plane holding the round's update, which is a combination of the round's "
        "inputs (bias-free first layer); the client projects out its own inputs and takes the "
        "direction common to all planes. It recovers the input up to scale (scaled here to "
        "the norm of its prior, the mean of its own shard) when the others' update holds one "
        "example."
    )

    def run(self, ctx: AuditContext) -> AttackResult:
        rec = ctx.recording
        own = ctx.shard(ctx.attacker).x
        bounds = Bounds.of(own)
        scores = Scores.empty()
        attacked: list[dict[str, object]] = []
        why = "no two consecutive recorded rounds with the attacker in both"
        for t, t1 in _pairs(ctx):
            first = ctx.view.first_layer(rec.instructions[t][ctx.attacker])
            second = ctx.view.first_layer(rec.instructions[t1][ctx.attacker])
            others = _others(ctx, t)
            if first is None or second is None:
                why = "the model has no fully connected first layer"
                break
            if not others:
                why = "the attacker was the only participant"
                continue
            if len(own.reshape(len(own), -1)) >= own[0].size:
                why = "the attacker holds at least as many examples as an input has features"
                break
            direction, rows = plane_intersection(first, second, own)
            if rows == 0:
                why = "no first-layer row changed"
                continue
            targets = np.concatenate([ctx.shard(k).x for k in others])
            scores.add(scale_direction(direction, bounds)[None, :], targets, bounds)
            attacked.append(
                {"rounds": [t, t1], "others": others, "examples": len(targets), "rows": rows}
            )
        details = {"pairs": attacked, "why": why}
        return _finish(self, ctx, scores, bounds, details, tag=24)


class CorrectionLeak(Attack):
    """Digest 000 G6: the server reads inputs off mpdp's per-client Phi and Psi."""

    name = "correction-leak"
    title = "Correction tensors (Phi, Psi) leak"
    view = "server"
    protocols = frozenset({"mpdp"})
    assumes = (
        "The server takes the first-layer rows of each attacked client's Phi and Psi (in the "
        "clear and without noise in Faithful mode; fixed-point words under pairwise uniform "
        "masks in Hardened mode, read here as numbers) and keeps their top right singular "
        "vector: for a one-example shard every row is a multiple of the input. Scaled to the "
        "norm of the held-out mean."
    )

    def run(self, ctx: AuditContext) -> AttackResult:
        rec = ctx.recording
        bounds = Bounds.of(ctx.test().x)
        scores = Scores.empty()
        attacked: list[dict[str, object]] = []
        masked = ctx.spec.protocol.mpdp.mode == "Hardened"
        for round_, client in _victims(ctx):
            upload = rec.uploads[round_][client]
            rows = ctx.view.corrections(upload)
            if rows is None:
                phi, psi = upload.tensors["phi.0"], upload.tensors["psi.0"]
                words = np.concatenate([phi, psi.reshape(-1, psi.shape[-1])])
                rows = words.view(np.int64).astype(np.float64)
            _, _, vt = np.linalg.svd(rows, full_matrices=False)
            shard = ctx.shard(client)
            scores.add(scale_direction(vt[0], bounds)[None, :], shard.x, bounds)
            attacked.append({"round": round_, "client": client, "examples": len(shard)})
        details = {"uploads": attacked, "masked": masked, "why": "no upload was recorded"}
        return _finish(self, ctx, scores, bounds, details, tag=25)
