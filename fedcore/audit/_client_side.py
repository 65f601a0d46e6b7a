"""Attacks on the model a client receives: output-noise fitting and membership inference.

* ``output-noise`` (digest 001 §7b S2, digest 000 G7): perturb and mpdp shift every output
  by alpha * r, with alpha computable by the client and r secret; least squares on the
  client's own labelled shard, r^ = sum alpha (y^ - t) / sum alpha^2, removes it.
* ``membership-loss`` (Yeom, Giacomelli, Fredrikson and Jha, CSF 2018): an example whose
  loss under the model is low was probably trained on; the threshold is the attacker's own
  (member) shard's mean loss.
* ``membership-shadow`` (Shokri, Stronati, Song and Shmatikov, S&P 2017): the attacker
  trains shadow models like the target on halves of its own shard and learns, from their
  outputs, a classifier of member against non-member.

Membership is scored on the other clients' training examples (members) against the
server's held-out split (non-members), balanced. For the perturbation protocols each is run
twice: on the outputs as received (the papers' setting) and on the outputs after the fit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from fedcore.audit import _figures
from fedcore.audit._attack import Attack, AttackResult, AuditContext
from fedcore.audit._metrics import (
    Estimate,
    bootstrap_auc,
    proportion,
    roc_auc,
    roc_curve,
)
from fedcore.audit._views import BroadcastModel, PlainView
from fedcore.learning.data import ArrayDataset
from fedcore.learning.models import build_model, get_weights, set_weights
from fedcore.learning.training import LocalLearner
from fedcore.transport import Payload

REFERENCE = "true model (reference)"
"""The variant scored on the server's true model: not what the client holds, a yardstick."""

SHADOW_EPOCHS_CAP = 100
"""The most local epochs a shadow model of a model-averaging protocol trains for."""


def fit_output_shift(model: BroadcastModel, x: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """r^ by least squares on labelled examples: sum alpha (y^ - t) / sum alpha^2."""
    outputs, alpha = model.outputs(x.reshape(len(x), -1))
    targets = np.eye(outputs.shape[1])[labels]
    return (alpha[:, None] * (outputs - targets)).sum(axis=0) / float(alpha @ alpha)


def _attacker_rounds(ctx: AuditContext) -> list[int]:
    """The kept rounds in which the attacker received an instruction."""
    rec = ctx.recording
    return [t for t in sorted(rec.instructions) if ctx.attacker in rec.instructions[t]]


class OutputNoise(Attack):
    """Least squares for the output shift; agreement with the true model's predictions."""

    name = "output-noise"
    title = "Output-noise fitting (least squares)"
    view = "client"
    protocols = frozenset({"perturb", "mpdp"})
    assumes = (
        "A participating client computes, on its own labelled shard, the perturbed outputs "
        "y^ and alpha (the sum of the activations feeding the last layer), fits the output "
        "shift r by least squares and predicts with y^ - alpha r^. Scored on the held-out "
        "split: how often its top class is the true model's, in the last two recorded rounds "
        "it took part in. Chance is the best blind guess, always the true model's most "
        "frequent top class."
    )

    def run(self, ctx: AuditContext) -> AttackResult:
        rec = ctx.recording
        own, test = ctx.shard(ctx.attacker), ctx.test()
        plain = PlainView(ctx.spec)
        naive_hits = fitted_hits = trials = correct_true = correct_fitted = 0
        errors: list[float] = []
        top: list[np.ndarray] = []
        rounds = _attacker_rounds(ctx)[-2:]
        for t in rounds:
            model = ctx.view.broadcast(rec.instructions[t][ctx.attacker])
            r_hat = fit_output_shift(model, own.x, own.y)
            outputs, alpha = model.outputs(test.x.reshape(len(test), -1))
            fitted = outputs - alpha[:, None] * r_hat
            true, _ = plain.broadcast(Payload(tensors=rec.before[t])).outputs(
                test.x.reshape(len(test), -1)
            )
            truth = true.argmax(axis=1)
            top.append(truth)
            naive_hits += int((outputs.argmax(axis=1) == truth).sum())
            fitted_hits += int((fitted.argmax(axis=1) == truth).sum())
            trials += len(test)
            correct_true += int((truth == test.y).sum())
            correct_fitted += int((fitted.argmax(axis=1) == test.y).sum())
            errors.append(float(np.linalg.norm(fitted - true) / np.linalg.norm(true)))
        if not trials:
            return self.result(skipped="the attacker received no recorded instruction")
        counts = np.bincount(np.concatenate(top), minlength=ctx.view.num_classes)
        chance = float(counts.max() / counts.sum())
        fitted_est = proportion("agreement, fitted", fitted_hits, trials, chance)
        naive_est = proportion("agreement, as received", naive_hits, trials, chance)
        estimates: list[Estimate] = [
            fitted_est,
            naive_est,
            proportion("accuracy, fitted predictor", correct_fitted, trials, None),
            proportion("accuracy, true model", correct_true, trials, None),
        ]
        cells = ctx.spec.protocol.perturb.cells if ctx.spec.protocol.name == "perturb" else None
        paper_bound = 1.0 / (cells or ctx.view.num_classes)
        figure = f"{self.name}.png"
        _figures.bars(ctx.figures / figure, estimates[:2], f"{self.title}: agreement")
        return self.result(
            verdict=fitted_est,
            estimates=estimates,
            details={
                "rounds": rounds,
                "own_examples": len(own),
                "relative_logit_error": float(np.mean(errors)),
                "paper_bound": paper_bound,
            },
            figures=[str(Path(ctx.figures.name) / figure)],
        )


# -------------------------------------------------------------------------- membership


def _losses(outputs: np.ndarray, labels: np.ndarray, loss: str) -> np.ndarray:
    """Per-example training loss of ``outputs``."""
    if loss == "MSE":
        targets = np.eye(outputs.shape[1])[labels]
        return ((outputs - targets) ** 2).mean(axis=1)
    top = outputs.max(axis=1, keepdims=True)
    logsumexp = top[:, 0] + np.log(np.exp(outputs - top).sum(axis=1))
    return logsumexp - outputs[np.arange(len(labels)), labels]


def _features(outputs: np.ndarray, labels: np.ndarray, loss: str) -> np.ndarray:
    """The shadow attack's features: loss, the label's output, the best other output, gap."""
    rows = np.arange(len(labels))
    own = outputs[rows, labels]
    others = outputs.copy()
    others[rows, labels] = -np.inf
    best = others.max(axis=1)
    return np.stack([_losses(outputs, labels, loss), own, best, own - best], axis=1)


class _Target:
    """The model the attacker client holds, as received and (if perturbed) after the fit, and
    then the true model it was perturbed from, as a reference only."""

    def __init__(self, ctx: AuditContext) -> None:
        rounds = _attacker_rounds(ctx)
        self.round = rounds[-1] if rounds else None
        self.variants: dict[str, tuple[BroadcastModel, np.ndarray | None]] = {}
        if self.round is None:
            return
        own = ctx.shard(ctx.attacker)
        loss = ctx.spec.training.loss
        model = min(
            ctx.view.models(ctx.recording.instructions[self.round][ctx.attacker]),
            key=lambda m: float(
                _losses(m.outputs(own.x.reshape(len(own), -1))[0], own.y, loss).mean()
            ),
        )
        self.variants["as received"] = (model, None)
        if ctx.view.perturbed:
            self.variants["fitted"] = (model, fit_output_shift(model, own.x, own.y))
            true = Payload(tensors=ctx.recording.before[self.round])
            self.variants[REFERENCE] = (PlainView(ctx.spec).broadcast(true), None)

    @staticmethod
    def outputs(variant: tuple[BroadcastModel, np.ndarray | None], x: np.ndarray) -> np.ndarray:
        """The variant's outputs on ``x``."""
        model, shift = variant
        outputs, alpha = model.outputs(x.reshape(len(x), -1))
        return outputs if shift is None else outputs - alpha[:, None] * shift


def _evaluation(ctx: AuditContext, last: int) -> tuple[ArrayDataset, np.ndarray] | None:
    """Balanced members (other clients trained on before ``last``) and non-members."""
    trained = sorted(
        {k for t, ks in ctx.recording.participants.items() if t < last for k in ks} - {ctx.attacker}
    )
    if not trained:
        return None
    members = [ctx.shard(k) for k in trained]
    member_x = np.concatenate([m.x for m in members])
    member_y = np.concatenate([m.y for m in members])
    test = ctx.test()
    n = min(ctx.budget.mi_samples, len(member_y), len(test))
    if n < 2:
        return None
    rng = ctx.rng(31)
    pick_in = rng.choice(len(member_y), n, replace=False)
    pick_out = rng.choice(len(test), n, replace=False)
    x = np.concatenate([member_x[pick_in], test.x[pick_out]])
    y = np.concatenate([member_y[pick_in], test.y[pick_out]])
    labels = np.concatenate([np.ones(n, bool), np.zeros(n, bool)])
    return ArrayDataset(x, y, test.num_classes), labels


class _Membership(Attack):
    """What both membership attacks share: the target, the evaluation set, the report."""

    view = "client"
    tag = 0

    def scores(
        self, ctx: AuditContext, target: _Target, variant: str, data: ArrayDataset
    ) -> tuple[np.ndarray, Estimate | None]:
        """Membership scores (higher: member) and an accuracy at the attack's threshold."""
        raise NotImplementedError

    def run(self, ctx: AuditContext) -> AttackResult:
        target = _Target(ctx)
        if target.round is None:
            return self.result(skipped="the attacker received no recorded instruction")
        evaluation = _evaluation(ctx, target.round)
        if evaluation is None:
            return self.result(skipped="no other client had trained before the last round")
        data, labels = evaluation
        rng = ctx.rng(self.tag)
        estimates: list[Estimate] = []
        curves = {}
        for variant in target.variants:
            scores, accuracy = self.scores(ctx, target, variant, data)
            estimates.append(bootstrap_auc(f"AUC, {variant}", scores, labels, rng))
            if accuracy is not None:
                estimates.append(accuracy)
            fpr, tpr = roc_curve(scores, labels)
            curves[variant] = (fpr, tpr, roc_auc(scores, labels))
        verdict = estimates[2] if "fitted" in target.variants else estimates[0]
        figure = f"{self.name}.png"
        _figures.roc(ctx.figures / figure, curves, f"{self.title}: {ctx.spec.protocol.name}")
        return self.result(
            verdict=verdict,
            estimates=[verdict, *(e for e in estimates if e is not verdict)],
            details={
                "round": target.round,
                "members": int(labels.sum()),
                "non_members": int((~labels).sum()),
            },
            figures=[str(Path(ctx.figures.name) / figure)],
        )


class MembershipLoss(_Membership):
    """Loss-threshold membership inference on the model a client holds."""

    name = "membership-loss"
    title = "Membership inference, loss threshold"
    tag = 41
    assumes = (
        "A participating client scores each example by its loss under the last model it "
        "received (lower: member) and calls members those below its own shard's mean loss "
        "(Yeom et al. 2018). Members: other clients' training examples; non-members: the "
        "held-out split; balanced. For perturb and mpdp also after fitting the output shift."
    )

    def scores(
        self, ctx: AuditContext, target: _Target, variant: str, data: ArrayDataset
    ) -> tuple[np.ndarray, Estimate | None]:
        loss = ctx.spec.training.loss
        own = ctx.shard(ctx.attacker)
        chosen = target.variants[variant]
        threshold = float(_losses(_Target.outputs(chosen, own.x), own.y, loss).mean())
        losses = _losses(_Target.outputs(chosen, data.x), data.y, loss)
        members = np.zeros(len(losses), bool)
        members[: len(losses) // 2] = True
        hits = int(((losses <= threshold) == members).sum())
        return -losses, proportion(f"accuracy at threshold, {variant}", hits, len(losses), 0.5)


class MembershipShadow(_Membership):
    """Shadow-model membership inference on the model a client holds."""

    name = "membership-shadow"
    title = "Membership inference, shadow models"
    tag = 42
    assumes = (
        "A participating client trains shadow models of the same architecture like the run "
        "trains (the same steps or epochs, learning rate and loss; no DP noise) on random "
        "halves of its own shard, and fits a logistic regression telling their members from "
        "their non-members by the loss, the label's output, the best other output and their "
        "gap (Shokri et al. 2017). It applies it to the last model it received."
    )

    def __init__(self) -> None:
        self._cache: tuple[AuditContext, Any] | None = None

    def run(self, ctx: AuditContext) -> AttackResult:
        try:
            return super().run(ctx)
        finally:
            self._cache = None  # the attack outlives the audit: keep no context alive

    def skip_reason(self, ctx: AuditContext) -> str | None:
        if len(ctx.shard(ctx.attacker)) < 4:
            return "the attacker's shard is too small to train shadow models (fewer than 4)"
        return super().skip_reason(ctx)

    def scores(
        self, ctx: AuditContext, target: _Target, variant: str, data: ArrayDataset
    ) -> tuple[np.ndarray, Estimate | None]:
        loss = ctx.spec.training.loss
        classifier = self._train(ctx, target)
        features = _features(_Target.outputs(target.variants[variant], data.x), data.y, loss)
        probability = classifier.predict_proba(features)[:, 1]
        members = np.zeros(len(probability), bool)
        members[: len(probability) // 2] = True
        hits = int(((probability >= 0.5) == members).sum())
        return probability, proportion(f"accuracy, {variant}", hits, len(probability), 0.5)

    def _train(self, ctx: AuditContext, target: _Target) -> Any:
        """The attack classifier, trained once per audit on the shadow models' outputs."""
        if self._cache is not None and self._cache[0] is ctx:
            return self._cache[1]
        spec, own = ctx.spec, ctx.shard(ctx.attacker)
        loss = spec.training.loss
        rng = ctx.rng(43)
        rows: list[np.ndarray] = []
        labels: list[np.ndarray] = []
        steps = max((target.round or 2) - 1, 1)
        for shadow in range(ctx.budget.shadow_models):
            order = rng.permutation(len(own))
            half = len(own) // 2
            inside, outside = own.subset(order[:half]), own.subset(order[half:])
            model = _shadow_model(ctx, inside, steps, seed=int(rng.integers(1 << 30)) + shadow)
            for part, member in ((inside, True), (outside, False)):
                with torch.no_grad():
                    x = torch.as_tensor(part.x).to(next(model.parameters()).dtype)
                    outputs = model(x).double().numpy()
                rows.append(_features(outputs, part.y, loss))
                labels.append(np.full(len(part), member))
        classifier = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000))
        classifier.fit(np.concatenate(rows), np.concatenate(labels))
        self._cache = (ctx, classifier)
        return classifier


def _shadow_model(
    ctx: AuditContext, data: ArrayDataset, steps: int, *, seed: int
) -> torch.nn.Module:
    """A model trained on ``data`` like the run trains its global model (no DP noise)."""
    spec = ctx.spec
    model = build_model(spec.model, data.input_shape, data.num_classes, seed=seed)
    learner = LocalLearner(model, data, spec.training, seed=seed, client_index=0)
    weights = get_weights(model)
    if spec.protocol.name in ("fedavg", "dp-fedavg") or spec.training.local_epochs > 1:
        epochs = min(steps * spec.training.local_epochs, SHADOW_EPOCHS_CAP)
        weights, _ = learner.train(weights, round=0, epochs=epochs)
    else:
        rate = spec.training.optimizer.learning_rate
        for _ in range(steps):
            gradient, _ = learner.gradient(weights, round=0)
            weights = {n: w - np.asarray(rate, w.dtype) * gradient[n] for n, w in weights.items()}
    set_weights(model, weights)
    return model.eval()
