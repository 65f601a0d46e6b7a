"""Reconstructing inputs: gradient inversion (DLG, inverting gradients) and its scoring.

* **DLG** (Zhu, Liu and Han, "Deep Leakage from Gradients", NeurIPS 2019): dummy inputs and
  soft labels are optimised with L-BFGS until their gradient at the broadcast parameters
  matches the observed one in squared L2 distance.
* **Inverting gradients** (Geiping, Bauermeister, Droege and Moeller, "Inverting Gradients -
  How easy is it to break privacy in federated learning?", NeurIPS 2020): the same, but the
  distance is one minus the cosine similarity (so a scaled or multi-step update is matched by
  its direction), with a total-variation prior and a box constraint, optimised with Adam.

A single-example batch starts from the label read off the last layer's gradient (its most
negative row, as in iDLG). Reconstructions are scored against the victim's true examples
after matching them one to one (Hungarian, on MSE); the blind guess they must beat is the
attacker's prior, the mean of the data it holds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment

from fedcore.audit._metrics import Estimate, bootstrap_mean, mse, psnr, ssim
from fedcore.audit._views import BroadcastModel

TV_WEIGHT = 1e-3
"""The total-variation weight of inverting gradients (inputs in [0, 1], cosine loss)."""


@dataclass(frozen=True)
class Bounds:
    """The attacker's knowledge of the data's range and a prior image.

    Attributes:
        low: the smallest feature value.
        high: the largest feature value.
        prior: the mean example of the data the attacker holds (its blind guess).
        shape: one example's shape (for total variation and SSIM).
    """

    low: float
    high: float
    prior: np.ndarray
    shape: tuple[int, ...]

    @classmethod
    def of(cls, x: np.ndarray) -> Bounds:
        """The bounds of the attacker's own data ``x`` (n, ...)."""
        flat = np.asarray(x, np.float64)
        return cls(float(flat.min()), float(flat.max()), flat.mean(axis=0), tuple(x.shape[1:]))

    @property
    def range(self) -> float:
        """The data range (PSNR's peak)."""
        return max(self.high - self.low, 1e-12)


def infer_label(gradient: Mapping[str, np.ndarray], num_classes: int) -> int | None:
    """The label of a one-example gradient: its last layer's most negative row (iDLG)."""
    for value in reversed(list(gradient.values())):
        if value.ndim == 2 and value.shape[0] == num_classes:
            return int(np.argmin(value.sum(axis=1)))
    return None


def invert(
    model: BroadcastModel,
    target: Mapping[str, np.ndarray],
    *,
    batch: int,
    num_classes: int,
    bounds: Bounds,
    method: str,
    iterations: int,
    rng: np.random.Generator,
    restarts: int = 1,
) -> np.ndarray:
    """Reconstructs ``batch`` inputs whose mean-loss gradient at ``model`` matches ``target``.

    With ``restarts`` above 1 it starts again from fresh dummies and keeps the attempt whose
    gradient matches best (the attacker can compute that; it never sees the true inputs).

    Args:
        model: the broadcast model the gradient was taken at.
        target: the observed gradient (or update) by parameter name.
        batch: the number of examples behind it.
        num_classes: the number of labels.
        bounds: the data range and shape.
        method: ``dlg`` or ``inverting-gradients``.
        iterations: L-BFGS iterations (dlg) or Adam steps.
        rng: the dummy inputs' randomness.
        restarts: attempts from fresh dummies.

    Returns:
        The reconstructions, shape (batch, features), clipped to the data range.
    """
    attempts = [
        _invert_once(
            model,
            target,
            batch=batch,
            num_classes=num_classes,
            bounds=bounds,
            method=method,
            iterations=iterations,
            rng=rng,
        )
        for _ in range(max(restarts, 1))
    ]
    return min(attempts, key=lambda attempt: attempt[1])[0]


def _invert_once(
    model: BroadcastModel,
    target: Mapping[str, np.ndarray],
    *,
    batch: int,
    num_classes: int,
    bounds: Bounds,
    method: str,
    iterations: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, float]:
    """One inversion from fresh dummies; the reconstructions and their final distance."""
    names = [n for n in target if n in model.params]
    params = {n: t.clone().requires_grad_(n in names) for n, t in model.params.items()}
    goal = [torch.as_tensor(np.asarray(target[n], np.float64)) for n in names]
    goal_norm = math.sqrt(sum(float((g * g).sum()) for g in goal)) or 1.0
    features = int(np.prod(bounds.shape))
    x = torch.tensor(
        rng.uniform(bounds.low, bounds.high, size=(batch, features)), requires_grad=True
    )
    logits = torch.zeros(batch, num_classes, dtype=torch.float64)
    label = infer_label(target, num_classes) if batch == 1 else None
    if label is not None:
        logits[0, label] = 4.0
    logits.requires_grad_(True)

    def distance(grads: list[torch.Tensor]) -> torch.Tensor:
        """DLG: squared L2 over the target's squared norm; else one minus the cosine."""
        dot = torch.zeros((), dtype=torch.float64)
        square = torch.zeros((), dtype=torch.float64)
        for g, t in zip(grads, goal, strict=True):
            if method == "dlg":
                square = square + ((g - t) ** 2).sum()
            else:
                dot = dot + (g * t).sum()
                square = square + (g * g).sum()
        if method == "dlg":
            return square / goal_norm**2
        return 1.0 - dot / ((torch.sqrt(square) + 1e-30) * goal_norm)

    def gradients() -> list[torch.Tensor]:
        out, _ = model.forward(params, x)
        soft = torch.softmax(logits, dim=1)
        if model.loss == "MSE":
            loss = F.mse_loss(out, soft)
        else:
            loss = -(soft * torch.log_softmax(out, dim=1)).sum(dim=1).mean()
        return list(torch.autograd.grad(loss, [params[n] for n in names], create_graph=True))

    if method == "dlg":
        optimizer = torch.optim.LBFGS(
            [x, logits],
            lr=1.0,
            max_iter=iterations,
            history_size=100,
            tolerance_grad=1e-14,
            tolerance_change=1e-16,
            line_search_fn="strong_wolfe",
        )

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            objective = distance(gradients())
            objective.backward()
            return objective

        optimizer.step(closure)
    else:
        adam = torch.optim.Adam([x, logits], lr=0.05)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(adam, T_max=iterations)
        for _ in range(iterations):
            adam.zero_grad()
            objective = distance(gradients()) + TV_WEIGHT * _tv(x, bounds.shape)
            objective.backward()
            adam.step()
            schedule.step()
            with torch.no_grad():
                x.clamp_(bounds.low, bounds.high)
    final = float(distance(gradients()).detach())
    return np.clip(x.detach().numpy(), bounds.low, bounds.high), final


def _tv(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The anisotropic total variation of images (0 for inputs that are not images)."""
    if len(shape) < 2 or shape[-1] < 2 or shape[-2] < 2:
        return torch.zeros((), dtype=x.dtype)
    images = x.reshape(x.shape[0], -1, shape[-2], shape[-1])
    dx = (images[..., 1:] - images[..., :-1]).abs().mean()
    dy = (images[..., 1:, :] - images[..., :-1, :]).abs().mean()
    return dx + dy


# ----------------------------------------------------------------------------- scoring


@dataclass
class Scores:
    """Per matched target: the reconstruction's and the prior's scores (pooled over uploads).

    Attributes:
        psnr, ssim, mse, cosine: the reconstruction against its target.
        prior_psnr, prior_ssim, prior_mse, prior_cosine: the prior against the same target.
        pairs: (target, reconstruction) pairs kept for the figure.
    """

    psnr: list[float]
    ssim: list[float]
    mse: list[float]
    cosine: list[float]
    prior_psnr: list[float]
    prior_ssim: list[float]
    prior_mse: list[float]
    prior_cosine: list[float]
    pairs: list[tuple[np.ndarray, np.ndarray]]

    @classmethod
    def empty(cls) -> Scores:
        """No targets scored yet."""
        return cls([], [], [], [], [], [], [], [], [])

    def add(self, reconstructions: np.ndarray, targets: np.ndarray, bounds: Bounds) -> None:
        """Matches reconstructions to targets one to one (or each to its nearest) and scores."""
        recon = reconstructions.reshape(len(reconstructions), -1).astype(np.float64)
        true = targets.reshape(len(targets), -1).astype(np.float64)
        cost = ((recon[:, None, :] - true[None, :, :]) ** 2).mean(axis=2)
        if len(recon) == len(true):
            rows, cols = linear_sum_assignment(cost)
        else:
            rows, cols = np.arange(len(recon)), cost.argmin(axis=1)
        prior = bounds.prior.reshape(-1)
        for r, c in zip(rows, cols, strict=True):
            shape = bounds.shape
            self.psnr.append(psnr(true[c], recon[r], data_range=bounds.range))
            self.ssim.append(
                ssim(true[c].reshape(shape), recon[r].reshape(shape), data_range=bounds.range)
            )
            self.mse.append(mse(true[c], recon[r]))
            self.cosine.append(_cosine(true[c], recon[r]))
            self.prior_psnr.append(psnr(true[c], prior, data_range=bounds.range))
            self.prior_ssim.append(
                ssim(true[c].reshape(shape), prior.reshape(shape), data_range=bounds.range)
            )
            self.prior_mse.append(mse(true[c], prior))
            self.prior_cosine.append(_cosine(true[c], prior))
            self.pairs.append((true[c], recon[r]))

    def estimates(self, rng: np.random.Generator) -> list[Estimate]:
        """The verdict (the mean PSNR gain over the prior on the same targets, paired), then
        PSNR, SSIM, MSE and the absolute cosine, each beside the prior's mean."""
        psnr_gain = np.subtract(self.psnr, self.prior_psnr)
        return [
            bootstrap_mean("PSNR gain over the prior (dB)", psnr_gain, rng, chance=0.0),
            bootstrap_mean("PSNR (dB)", np.array(self.psnr), rng, chance=_mean(self.prior_psnr)),
            bootstrap_mean("SSIM", np.array(self.ssim), rng, chance=_mean(self.prior_ssim)),
            bootstrap_mean(
                "MSE",
                np.array(self.mse),
                rng,
                chance=_mean(self.prior_mse),
                attacker_higher=False,
            ),
            bootstrap_mean(
                "cosine (absolute)", np.array(self.cosine), rng, chance=_mean(self.prior_cosine)
            ),
        ]


def _mean(values: Sequence[float]) -> float:
    """The mean of a list (nan when empty)."""
    return float(np.mean(values)) if values else float("nan")


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    """|cos| of the angle between two vectors (0 for a zero vector)."""
    denominator = float(np.linalg.norm(a) * np.linalg.norm(b))
    return abs(float(a @ b)) / denominator if denominator > 0 else 0.0


def scale_direction(direction: np.ndarray, bounds: Bounds) -> np.ndarray:
    """A direction recovered up to scale and sign, turned into an input: the sign that agrees
    with the prior, the prior's norm, clipped to the data range."""
    v = direction.reshape(-1).astype(np.float64)
    prior = bounds.prior.reshape(-1)
    if float(v @ prior) < 0:
        v = -v
    norm = float(np.linalg.norm(v))
    if norm > 0:
        v = v * (float(np.linalg.norm(prior)) / norm)
    return np.clip(v, bounds.low, bounds.high)
