"""The audit's measures: reconstruction quality, attack scores, and their confidence intervals."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.stats import rankdata

Z_95 = 1.959963984540054
"""The standard normal quantile of a two-sided 95% interval."""

BOOTSTRAP_RESAMPLES = 1000
"""Resamples per bootstrap interval."""


@dataclass(frozen=True)
class Estimate:
    """One measured number with its 95% interval and what blind guessing would score.

    Attributes:
        name: what it measures, e.g. ``AUC`` or ``PSNR gain over the prior (dB)``.
        value: the point estimate.
        low: the interval's lower end.
        high: the interval's upper end.
        n: how many trials or targets it rests on.
        interval: how the interval was computed (``Wilson``, ``bootstrap``, ``none``).
        chance: what blind guessing scores on the same measure, or None (descriptive only).
        attacker_higher: whether a higher value means a stronger attack.
    """

    name: str
    value: float
    low: float
    high: float
    n: int
    interval: str
    chance: float | None = None
    attacker_higher: bool = True

    @property
    def beats_chance(self) -> bool | None:
        """Whether the interval excludes chance on the attacker's side (None: no chance)."""
        if self.chance is None:
            return None
        if self.attacker_higher:
            return self.low > self.chance
        return self.high < self.chance

    def as_json(self) -> dict[str, object]:
        """The estimate as a JSON-able dict."""
        return {
            "name": self.name,
            "value": self.value,
            "low": self.low,
            "high": self.high,
            "n": self.n,
            "interval": self.interval,
            "chance": self.chance,
            "attacker_higher": self.attacker_higher,
            "beats_chance": self.beats_chance,
        }


# ------------------------------------------------------------------------ reconstruction


def mse(a: np.ndarray, b: np.ndarray) -> float:
    """The mean squared error between two arrays of the same shape."""
    return float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))


def psnr(reference: np.ndarray, estimate: np.ndarray, *, data_range: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB; capped at 100 dB for an exact match."""
    error = mse(reference, estimate)
    if error <= data_range**2 * 1e-10:
        return 100.0
    return float(10.0 * math.log10(data_range**2 / error))


def ssim(reference: np.ndarray, estimate: np.ndarray, *, data_range: float = 1.0) -> float:
    """Structural similarity (Wang et al. 2004) of two images, mean over the image.

    Images are 2-D (or channels first, averaged over channels; a vector is one row). The
    window is uniform, 7 pixels or the image's smaller side if odd (else one less), with the
    usual K1 = 0.01, K2 = 0.03 and the sample covariance, as scikit-image's default.
    """
    ref = np.asarray(reference, np.float64)
    est = np.asarray(estimate, np.float64)
    if ref.ndim == 1:
        ref, est = ref[None, None, :], est[None, None, :]
    elif ref.ndim == 2:
        ref, est = ref[None], est[None]
    ref = ref.reshape(-1, *ref.shape[-2:])
    est = est.reshape(-1, *est.shape[-2:])
    if ref.shape[-2] == 1:  # a vector: a 1-D window along it
        shape = (1, _odd_window(ref.shape[-1]))
    else:
        side = _odd_window(min(ref.shape[-2:]))
        shape = (side, side)
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    values = []
    for a, b in zip(ref, est, strict=True):
        mu_a, mu_b = _box(a, shape), _box(b, shape)
        size = shape[0] * shape[1]
        correction = size / max(size - 1, 1)
        var_a = (_box(a * a, shape) - mu_a**2) * correction
        var_b = (_box(b * b, shape) - mu_b**2) * correction
        cov = (_box(a * b, shape) - mu_a * mu_b) * correction
        index = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / (
            (mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2)
        )
        values.append(float(index.mean()))
    return float(np.mean(values))


def _odd_window(size: int) -> int:
    """7, or the largest odd number not above ``size``."""
    side = min(7, size)
    return max(side if side % 2 == 1 else side - 1, 1)


def _box(image: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """The mean over every full window of ``shape`` (valid positions only)."""
    windows = np.lib.stride_tricks.sliding_window_view(image, shape)
    return windows.mean(axis=(-2, -1))


# ---------------------------------------------------------------------- classification


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The area under the ROC curve (Mann-Whitney; ties count half); labels 1 = positive."""
    scores = np.asarray(scores, np.float64)
    labels = np.asarray(labels).astype(bool)
    positives, negatives = int(labels.sum()), int((~labels).sum())
    if positives == 0 or negatives == 0:
        raise ValueError("The AUC needs at least one positive and one negative example.")
    ranks = rankdata(scores)  # ties get their average rank
    total = float(ranks[labels].sum()) - positives * (positives + 1) / 2.0
    return total / (positives * negatives)


def roc_curve(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """False and true positive rates at every threshold, from (0, 0) to (1, 1)."""
    scores = np.asarray(scores, np.float64)
    labels = np.asarray(labels).astype(bool)
    order = np.argsort(-scores, kind="mergesort")
    hits = labels[order]
    tpr = np.concatenate([[0.0], np.cumsum(hits) / max(int(hits.sum()), 1)])
    fpr = np.concatenate([[0.0], np.cumsum(~hits) / max(int((~hits).sum()), 1)])
    return fpr, tpr


def wilson(successes: int, trials: int) -> tuple[float, float]:
    """The Wilson score 95% interval of a proportion."""
    if trials <= 0:
        return 0.0, 1.0
    p = successes / trials
    z2 = Z_95**2
    centre = (p + z2 / (2 * trials)) / (1 + z2 / trials)
    half = Z_95 * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials**2)) / (1 + z2 / trials)
    return max(0.0, centre - half), min(1.0, centre + half)


def proportion(name: str, successes: int, trials: int, chance: float | None) -> Estimate:
    """A share with its Wilson interval."""
    low, high = wilson(successes, trials)
    value = successes / trials if trials else float("nan")
    return Estimate(name, value, low, high, trials, "Wilson", chance)


def bootstrap_mean(
    name: str,
    values: np.ndarray,
    rng: np.random.Generator,
    *,
    chance: float | None = None,
    attacker_higher: bool = True,
) -> Estimate:
    """The mean of ``values`` with a percentile-bootstrap 95% interval (none for n < 2)."""
    values = np.asarray(values, np.float64)
    mean = float(values.mean())
    if len(values) < 2:
        return Estimate(name, mean, mean, mean, len(values), "none", chance, attacker_higher)
    picks = rng.integers(0, len(values), size=(BOOTSTRAP_RESAMPLES, len(values)))
    means = values[picks].mean(axis=1)
    low, high = np.quantile(means, [0.025, 0.975])
    return Estimate(
        name, mean, float(low), float(high), len(values), "bootstrap", chance, attacker_higher
    )


def bootstrap_auc(
    name: str, scores: np.ndarray, labels: np.ndarray, rng: np.random.Generator
) -> Estimate:
    """The AUC with a stratified percentile-bootstrap 95% interval; chance is 0.5."""
    return _bootstrap_stat(name, scores, labels, rng, roc_auc, chance=0.5)


def _bootstrap_stat(
    name: str,
    scores: np.ndarray,
    labels: np.ndarray,
    rng: np.random.Generator,
    stat: Callable[[np.ndarray, np.ndarray], float],
    *,
    chance: float,
) -> Estimate:
    """A statistic of (scores, labels) with a bootstrap interval stratified by label."""
    scores = np.asarray(scores, np.float64)
    labels = np.asarray(labels).astype(bool)
    positive, negative = np.flatnonzero(labels), np.flatnonzero(~labels)
    value = stat(scores, labels)
    samples = []
    for _ in range(BOOTSTRAP_RESAMPLES):
        rows = np.concatenate(
            [rng.choice(positive, len(positive)), rng.choice(negative, len(negative))]
        )
        samples.append(stat(scores[rows], labels[rows]))
    low, high = np.quantile(samples, [0.025, 0.975])
    return Estimate(name, value, float(low), float(high), len(scores), "bootstrap", chance)
