"""The statistics of a canary privacy audit: pure functions of canary scores, no I/O.

Each canary has a score (e.g. the cosine between the final model's movement and the canary's
fixed random direction; higher should mean "more likely inserted") and a flag saying whether it
was inserted into training. Two estimators:

* ``one_shot_estimate``: Andrew, Kairouz, Oh, Oprea, McMahan, Suriyakumar, "One-shot Empirical
  Privacy Estimation for Federated Learning", ICLR 2024 (arXiv:2302.03098). Fit a Gaussian to
  the inserted canaries' scores and one to the held-out canaries' scores; the estimate is the
  epsilon(delta) at which the two fitted Gaussians are (epsilon, delta)-indistinguishable. An
  estimate (with a bootstrap interval), not a bound.
* ``one_run_lower_bound``: Steinke, Nasr, Jagielski, "Privacy Auditing with One (1) Training
  Run", NeurIPS 2023 (arXiv:2305.08846). Guess membership for the highest and lowest scores;
  the number of correct guesses refutes (epsilon, delta)-DP up to some epsilon, at a stated
  confidence. A lower bound, valid whatever the scores are, if the canaries were inserted
  independently with probability 1/2.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike
from scipy.optimize import brentq
from scipy.special import bdtrc, expit, gammaln, log_expit, log_ndtr, ndtr

_EPSILON_CAP = 2.0**40
"""Past this epsilon the search stops and reports ``inf`` (the pair is distinguishable)."""

_LOG_GAP_FLOOR = 1000.0
"""The root searches clip log-probabilities this far below the target (keeps them finite)."""

_XTOL = 1e-13
"""Absolute tolerance of the epsilon root searches."""

_GUESS_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
"""The default candidate guess counts of the one-run bound, as fractions of the canaries."""

_MIN_DEFAULT_GUESSES = 10
"""Fewer guesses than this can refute nothing at usual confidences (0.5**10 ~ 1e-3)."""


# ---------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class OneShotEstimate:
    """The one-shot epsilon estimate (Andrew et al., ICLR 2024) with its bootstrap interval.

    Attributes:
        epsilon: epsilon(delta) of the two fitted Gaussians (``inf``: a fitted std is 0).
        low: lower end of the bootstrap interval (see ``one_shot_estimate``).
        high: upper end of the bootstrap interval.
        confidence: the interval's confidence, in (0, 1).
        delta: the delta the estimate is for.
        inserted: (mean, std) fitted to the inserted canaries' scores (std with ddof=1).
        held_out: (mean, std) fitted to the held-out canaries' scores (std with ddof=1).
        n_inserted: how many inserted canaries.
        n_held_out: how many held-out canaries.
        resamples: bootstrap resamples behind the interval.
        interval: the bootstrap interval's kind, ``basic`` or ``percentile``.
    """

    epsilon: float
    low: float
    high: float
    confidence: float
    delta: float
    inserted: tuple[float, float]
    held_out: tuple[float, float]
    n_inserted: int
    n_held_out: int
    resamples: int
    interval: str


@dataclass(frozen=True)
class OneRunBound:
    """The one-run epsilon lower bound (Steinke, Nasr, Jagielski, NeurIPS 2023).

    With probability at least ``confidence`` over the canaries' coin flips, an algorithm that
    is (epsilon', delta)-DP has epsilon' >= ``epsilon``.

    Attributes:
        epsilon: the lower bound (0 when nothing is refuted).
        confidence: the bound's confidence, in (0, 1), over all candidates together.
        delta: the delta the bound is for.
        guesses: r, the guesses of the chosen candidate (k_plus + k_minus).
        correct: v, how many of them were correct.
        canaries: m, all canaries (abstentions included).
        k_plus: "inserted" guesses, on the highest scores.
        k_minus: "held out" guesses, on the lowest scores.
        candidates: how many guess counts were tried (confidence is split over them).
    """

    epsilon: float
    confidence: float
    delta: float
    guesses: int
    correct: int
    canaries: int
    k_plus: int
    k_minus: int
    candidates: int


# ------------------------------------------------------------------------------ validation


def _open_unit(name: str, value: float) -> float:
    """``value`` as a float in (0, 1), else ValueError naming ``name``."""
    number = float(value)
    if not 0.0 < number < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return number


def _half_open_unit(name: str, value: float) -> float:
    """``value`` as a float in [0, 1), else ValueError naming ``name``."""
    number = float(value)
    if not 0.0 <= number < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return number


def _finite(name: str, value: float) -> float:
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return number


def _std(name: str, value: float) -> float:
    number = _finite(name, value)
    if number < 0.0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return number


def _scores(name: str, values: ArrayLike, *, at_least: int) -> np.ndarray:
    """``values`` as a 1-D float64 array of finite numbers, at least ``at_least`` long."""
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    if array.size < at_least:
        raise ValueError(f"{name} needs at least {at_least} canaries, got {array.size}")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must be finite (no nan or inf)")
    return array


# ---------------------------------------------------------- two Gaussians: the privacy curve


def _log_diff(x: float, y: float) -> float:
    """log(e^x - e^y), and -inf where that is not positive."""
    if y == -math.inf:
        return x
    if y >= x:
        return -math.inf
    gap = -math.expm1(y - x)
    return x + math.log(gap) if gap > 0.0 else -math.inf


def _log_above(t: float, mu: float, sigma: float) -> float:
    """log P[X > t] for X ~ N(mu, sigma^2)."""
    return float(log_ndtr((mu - t) / sigma))


def _log_below(t: float, mu: float, sigma: float) -> float:
    """log P[X < t] for X ~ N(mu, sigma^2)."""
    return float(log_ndtr((t - mu) / sigma))


def _log_between(a: float, b: float, mu: float, sigma: float) -> float:
    """log P[a < X < b] for X ~ N(mu, sigma^2) and a <= b, from the tail it lies in."""
    za, zb = (a - mu) / sigma, (b - mu) / sigma
    if za >= 0.0:
        return _log_diff(float(log_ndtr(-za)), float(log_ndtr(-zb)))
    if zb <= 0.0:
        return _log_diff(float(log_ndtr(zb)), float(log_ndtr(za)))
    outside = float(ndtr(za) + ndtr(-zb))
    return math.log1p(-outside) if outside < 1.0 else -math.inf


def _log_masses(
    mu_p: float, sigma_p: float, mu_q: float, sigma_q: float, epsilon: float
) -> tuple[float, float]:
    """(log P(S), log Q(S)) for S = {x : log p(x)/q(x) > epsilon}; both stds positive.

    The log-likelihood ratio of two Gaussians is a x^2 + b x + c: S is a half-line (a == 0),
    the outside of two roots (a > 0) or the inside (a < 0).
    """
    a = 0.5 / sigma_q**2 - 0.5 / sigma_p**2
    b = mu_p / sigma_p**2 - mu_q / sigma_q**2
    c = 0.5 * (mu_q / sigma_q) ** 2 - 0.5 * (mu_p / sigma_p) ** 2 + math.log(sigma_q / sigma_p)
    c -= epsilon
    if a == 0.0:
        if b == 0.0:
            return (0.0, 0.0) if c > 0.0 else (-math.inf, -math.inf)
        t = -c / b
        if b > 0.0:
            return _log_above(t, mu_p, sigma_p), _log_above(t, mu_q, sigma_q)
        return _log_below(t, mu_p, sigma_p), _log_below(t, mu_q, sigma_q)
    disc = b * b - 4.0 * a * c
    if disc <= 0.0:
        return (0.0, 0.0) if a > 0.0 else (-math.inf, -math.inf)
    k = -0.5 * (b + math.copysign(math.sqrt(disc), b))
    lo, hi = sorted((k / a, c / k))
    if a > 0.0:
        return (
            float(np.logaddexp(_log_below(lo, mu_p, sigma_p), _log_above(hi, mu_p, sigma_p))),
            float(np.logaddexp(_log_below(lo, mu_q, sigma_q), _log_above(hi, mu_q, sigma_q))),
        )
    return _log_between(lo, hi, mu_p, sigma_p), _log_between(lo, hi, mu_q, sigma_q)


def _log_hockey_stick(
    mu_p: float, sigma_p: float, mu_q: float, sigma_q: float, epsilon: float
) -> float:
    """log H_{e^eps}(P || Q) = log(P(S) - e^eps Q(S)); both stds positive."""
    log_p, log_q = _log_masses(mu_p, sigma_p, mu_q, sigma_q, epsilon)
    if log_p == -math.inf:
        return -math.inf
    return _log_diff(log_p, epsilon + log_q)


def gaussian_hockey_stick(
    mu_p: float, sigma_p: float, mu_q: float, sigma_q: float, epsilon: float
) -> float:
    """The hockey-stick divergence H_{e^eps}(P || Q) = ∫ max(0, p - e^eps q) in closed form.

    P = N(mu_p, sigma_p^2), Q = N(mu_q, sigma_q^2), epsilon >= 0. The integrand is positive
    exactly where the log-likelihood ratio (quadratic in x) exceeds epsilon, an interval or
    two half-lines, so H is a sum of normal CDFs. A zero std is a point mass: H is 0 for two
    equal point masses and 1 otherwise.
    """
    mu_p, mu_q = _finite("mu_p", mu_p), _finite("mu_q", mu_q)
    sigma_p, sigma_q = _std("sigma_p", sigma_p), _std("sigma_q", sigma_q)
    epsilon = _finite("epsilon", epsilon)
    if epsilon < 0.0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    if sigma_p == 0.0 or sigma_q == 0.0:
        return 0.0 if (sigma_p == sigma_q and mu_p == mu_q) else 1.0
    return math.exp(_log_hockey_stick(mu_p, sigma_p, mu_q, sigma_q, epsilon))


def _one_way_epsilon(
    mu_p: float, sigma_p: float, mu_q: float, sigma_q: float, delta: float
) -> float:
    """The least epsilon >= 0 with H_{e^eps}(P || Q) <= delta (H decreases in epsilon)."""
    log_delta = math.log(delta)

    def gap(epsilon: float) -> float:
        log_h = _log_hockey_stick(mu_p, sigma_p, mu_q, sigma_q, epsilon)
        return max(log_h, log_delta - _LOG_GAP_FLOOR) - log_delta

    if gap(0.0) <= 0.0:
        return 0.0
    lo, hi = 0.0, 1.0
    while gap(hi) > 0.0:
        if hi >= _EPSILON_CAP:
            return math.inf
        lo, hi = hi, 2.0 * hi
    return float(brentq(gap, lo, hi, xtol=_XTOL))


def gaussian_pair_epsilon(
    mu0: float, sigma0: float, mu1: float, sigma1: float, delta: float
) -> float:
    """epsilon(delta) of the pair N(mu0, sigma0^2), N(mu1, sigma1^2), both directions.

    The least epsilon >= 0 with max(H_{e^eps}(P0 || P1), H_{e^eps}(P1 || P0)) <= delta, found
    by brentq on the closed-form log H (see ``gaussian_hockey_stick``); 0 when delta already
    covers the pair (H at epsilon 0, their total variation, is <= delta). A zero std makes
    the pair distinguishable at every epsilon (``inf``) unless both are the same point mass;
    so does an epsilon past 2^40 (~1e12, e.g. stds a million-fold apart).
    For sigma0 == sigma1 == 1 and |mu1 - mu0| = mu this is the analytic Gaussian mechanism
    (Balle & Wang, ICML 2018): delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2).
    """
    mu0, mu1 = _finite("mu0", mu0), _finite("mu1", mu1)
    sigma0, sigma1 = _std("sigma0", sigma0), _std("sigma1", sigma1)
    delta = _open_unit("delta", delta)
    if sigma0 == 0.0 or sigma1 == 0.0:
        return 0.0 if (sigma0 == sigma1 and mu0 == mu1) else math.inf
    return max(
        _one_way_epsilon(mu0, sigma0, mu1, sigma1, delta),
        _one_way_epsilon(mu1, sigma1, mu0, sigma0, delta),
    )


# ------------------------------------------------------------------------ one-shot estimate


def one_shot_estimate(
    inserted: ArrayLike,
    held_out: ArrayLike,
    delta: float,
    confidence: float = 0.95,
    resamples: int = 1000,
    seed: int = 0,
    interval: Literal["basic", "percentile"] = "basic",
) -> OneShotEstimate:
    """The one-shot epsilon estimate of Andrew et al. (ICLR 2024, arXiv:2302.03098).

    Fits N(mean, std^2) (sample mean, std with ddof=1) to the inserted canaries' scores and to
    the held-out canaries' scores, and returns ``gaussian_pair_epsilon`` of the two fits at
    ``delta``: the paper's estimate of epsilon from the two fitted Gaussians, computed exactly.

    The interval comes from a bootstrap at ``confidence``: both groups are resampled with
    replacement ``resamples`` times (``numpy.random.default_rng(seed)``: deterministic) and the
    estimate recomputed, giving quantiles q_lo, q_hi. ``"percentile"`` reports [q_lo, q_hi];
    ``"basic"`` (the default) reports [2 e - q_hi, 2 e - q_lo] (e the estimate), clipped at 0.
    The estimate is biased upwards (noise in the two fitted stds only ever adds epsilon, the
    more so the smaller delta), the percentile interval inherits that bias and the basic one
    corrects it to first order: for 1000 canaries per group from N(0, 1) and N(1, 1) at
    delta 1e-5 (100 seeded trials, 1000 resamples) the true epsilon fell in 96 basic
    intervals and 66 percentile ones, and the estimate's error averaged +0.67 (sd 0.50).
    Either is an interval for this estimator, not a bound on the algorithm's epsilon, and the
    basic one, shifted down by the bias, need not contain the estimate. An infinite estimate
    or upper quantile (a zero fitted std) makes the interval [0, inf].

    Raises:
        ValueError: fewer than 2 scores in a group, a non-finite score, delta or confidence
            outside (0, 1), resamples < 1, an unknown interval (the message names the
            argument).
    """
    ins = _scores("inserted", inserted, at_least=2)
    out = _scores("held_out", held_out, at_least=2)
    delta = _open_unit("delta", delta)
    confidence = _open_unit("confidence", confidence)
    resamples = operator.index(resamples)
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    if interval not in ("basic", "percentile"):
        raise ValueError(f"interval must be 'basic' or 'percentile', got {interval!r}")

    def estimate(a: np.ndarray, b: np.ndarray) -> float:
        return gaussian_pair_epsilon(
            float(b.mean()), float(b.std(ddof=1)), float(a.mean()), float(a.std(ddof=1)), delta
        )

    epsilon = estimate(ins, out)
    rng = np.random.default_rng(seed)
    boot = np.empty(resamples)
    for i in range(resamples):
        boot[i] = estimate(
            ins[rng.integers(0, ins.size, ins.size)], out[rng.integers(0, out.size, out.size)]
        )
    tail = (1.0 - confidence) / 2.0
    q_lo, q_hi = (float(q) for q in np.quantile(boot, [tail, 1.0 - tail], method="inverted_cdf"))
    if not math.isfinite(epsilon) or not math.isfinite(q_hi):
        low, high = 0.0, math.inf
    elif interval == "basic":
        low, high = max(0.0, 2.0 * epsilon - q_hi), max(0.0, 2.0 * epsilon - q_lo)
    else:
        low, high = q_lo, q_hi
    return OneShotEstimate(
        epsilon=epsilon,
        low=low,
        high=high,
        confidence=confidence,
        delta=delta,
        inserted=(float(ins.mean()), float(ins.std(ddof=1))),
        held_out=(float(out.mean()), float(out.std(ddof=1))),
        n_inserted=int(ins.size),
        n_held_out=int(out.size),
        resamples=resamples,
        interval=interval,
    )


# -------------------------------------------------------------------------- one-run bound


def _counts(m: int, r: int, v: int) -> tuple[int, int, int]:
    m, r, v = operator.index(m), operator.index(r), operator.index(v)
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    if not 0 <= r <= m:
        raise ValueError(f"r must be in [0, m={m}], got {r}")
    if not 0 <= v <= r:
        raise ValueError(f"v must be in [0, r={r}], got {v}")
    return m, r, v


def _p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Steinke et al.'s bound on P[W >= v]; arguments already checked."""
    if v == 0:
        return 1.0
    q = float(expit(epsilon))  # e^eps / (e^eps + 1), the accuracy of randomized response
    tail = float(bdtrc(v - 1, r, q))  # f(v) = P[Binomial(r, q) >= v]
    if delta == 0.0:
        return min(1.0, tail)
    k = np.arange(v - 1, -1, -1, dtype=np.float64)  # v-1, v-2, ..., 0
    log_pmf = (
        gammaln(r + 1.0)
        - gammaln(k + 1.0)
        - gammaln(r - k + 1.0)
        + k * float(log_expit(epsilon))
        + (r - k) * float(log_expit(-epsilon))
    )
    # below[i-1] = P[v - i <= Binomial(r, q) < v] = f(v - i) - f(v), for i = 1..v.
    below = np.cumsum(np.exp(log_pmf))
    alpha = float(np.max(below / np.arange(1, v + 1)))
    return min(1.0, tail + 2.0 * m * delta * alpha)


def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Steinke et al.'s bound on P[at least v of r guesses correct] under (epsilon, delta)-DP.

    Steinke, Nasr, Jagielski, "Privacy Auditing with One (1) Training Run" (NeurIPS 2023,
    arXiv:2305.08846): the paper's main theorem, as its Appendix D code computes it. Take m
    canaries each inserted independently with probability 1/2 and an auditor making r guesses
    (abstaining on the rest), W of them correct. If the algorithm is (epsilon, delta)-DP,

        P[W >= v] <= f(v) + 2 m delta max_{i = 1..m} (f(v - i) - f(v)) / i,
        f(v) = P[Binomial(r, e^eps / (e^eps + 1)) >= v],

    (f(v - i) - f(v) = P[v - i <= Binomial < v]; for i > v the term is below i = v's). With
    delta = 0 this is the theorem's pure-DP case: W is stochastically dominated by
    Binomial(r, e^eps / (e^eps + 1)). Returned capped at 1.
    """
    m, r, v = _counts(m, r, v)
    epsilon = _finite("epsilon", epsilon)
    if epsilon < 0.0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    return _p_value(m, r, v, epsilon, _half_open_unit("delta", delta))


def one_run_epsilon(m: int, r: int, v: int, delta: float, beta: float) -> float:
    """The largest epsilon that v correct guesses out of r refute at level beta (one test).

    The epsilon with ``one_run_p_value(m, r, v, epsilon, delta) == beta``, found as in the
    paper's Appendix D (a search on epsilon; the p-value grows with epsilon), returned on the
    refuting side: ``one_run_p_value(..., result, ...) <= beta``. 0 when even epsilon = 0 is
    not refuted. With probability >= 1 - beta over the canaries' coin flips, an
    (epsilon', delta)-DP algorithm has epsilon' >= the result, for r and the guesses fixed in
    advance (choosing among several needs a union bound: see ``one_run_lower_bound``).
    """
    m, r, v = _counts(m, r, v)
    delta = _half_open_unit("delta", delta)
    beta = _open_unit("beta", beta)

    def excess(epsilon: float) -> float:
        return _p_value(m, r, v, epsilon, delta) - beta

    if excess(0.0) > 0.0:
        return 0.0
    lo, hi = 0.0, 1.0
    while excess(hi) <= 0.0:  # ends: the p-value tends to 1 as epsilon grows (v >= 1 here)
        lo, hi = hi, 2.0 * hi
    root = float(brentq(excess, lo, hi, xtol=_XTOL))
    for candidate in (root, root - 2.0 * _XTOL):
        if candidate >= lo and excess(candidate) <= 0.0:
            return candidate
    return lo


def _default_guess_counts(m: int) -> list[int]:
    counts = {min(m, max(_MIN_DEFAULT_GUESSES, round(f * m))) for f in _GUESS_FRACTIONS}
    return sorted(counts)


def _guess_counts(m: int, guess_counts: Sequence[int] | None) -> list[int]:
    if guess_counts is None:
        return _default_guess_counts(m)
    counts = sorted({operator.index(r) for r in guess_counts})
    if not counts:
        raise ValueError("guess_counts must not be empty")
    if counts[0] < 1 or counts[-1] > m:
        raise ValueError(f"guess_counts must be in [1, {m}] (the canaries), got {counts}")
    return counts


def _flags(scores: np.ndarray, inserted: ArrayLike) -> np.ndarray:
    raw = np.asarray(inserted)
    if raw.ndim != 1:
        raise ValueError(f"inserted must be one-dimensional, got shape {raw.shape}")
    if raw.size != scores.size:
        raise ValueError(
            f"inserted has {raw.size} flags but scores has {scores.size} canaries (mismatch)"
        )
    if raw.dtype != np.bool_ and not np.all((raw == 0) | (raw == 1)):
        raise ValueError("inserted must hold booleans (or 0/1)")
    flags = raw.astype(bool)
    n_in = int(flags.sum())
    if n_in < 2 or flags.size - n_in < 2:
        raise ValueError(
            f"inserted needs at least 2 inserted and 2 held-out canaries, "
            f"got {n_in} and {flags.size - n_in}"
        )
    return flags


def one_run_lower_bound(
    scores: ArrayLike,
    inserted: ArrayLike,
    delta: float,
    confidence: float = 0.95,
    guess_counts: Sequence[int] | None = None,
) -> OneRunBound:
    """The one-run epsilon lower bound of Steinke, Nasr, Jagielski (NeurIPS 2023).

    Precondition (the theorem's): each canary was inserted independently with probability
    1/2, and the scores were computed without looking at the flags. For each candidate guess
    count r the auditor guesses "inserted" for the ceil(r/2) highest scores (k_plus) and "held
    out" for the floor(r/2) lowest (k_minus), abstains on the rest, counts the correct guesses
    v, and computes ``one_run_epsilon(m, r, v, delta, beta / K)``. Picking the best of the K
    candidates after seeing the scores is paid for by a Bonferroni union bound: each test runs
    at level beta / K, beta = 1 - confidence, so the reported maximum holds at ``confidence``.
    The candidates are fixed before the scores are read: ``guess_counts`` or, by default,
    1%, 2%, 5%, 10%, 20%, 50% and 100% of the canaries (at least 10, at most m). Ties in the
    scores are broken by position. delta may be 0 (pure DP).

    Raises:
        ValueError: non-finite scores, mismatched lengths, fewer than 2 inserted or 2
            held-out canaries, delta outside [0, 1), confidence outside (0, 1), a guess count
            outside [1, m] (the message names the argument).
    """
    values = _scores("scores", scores, at_least=1)
    flags = _flags(values, inserted)
    delta = _half_open_unit("delta", delta)
    confidence = _open_unit("confidence", confidence)
    m = int(values.size)
    counts = _guess_counts(m, guess_counts)
    beta = (1.0 - confidence) / len(counts)

    ranked = flags[np.argsort(-values, kind="stable")]  # highest score first
    right_in = np.concatenate([[0], np.cumsum(ranked)])  # correct among the top k
    right_out = np.concatenate([[0], np.cumsum(~ranked[::-1])])  # correct among the bottom k

    def key(bound: OneRunBound) -> tuple[float, float]:
        return bound.epsilon, bound.correct / bound.guesses

    best: OneRunBound | None = None
    for r in counts:
        k_plus, k_minus = (r + 1) // 2, r // 2
        v = int(right_in[k_plus] + right_out[k_minus])
        bound = OneRunBound(
            epsilon=one_run_epsilon(m, r, v, delta, beta),
            confidence=confidence,
            delta=delta,
            guesses=r,
            correct=v,
            canaries=m,
            k_plus=k_plus,
            k_minus=k_minus,
            candidates=len(counts),
        )
        if best is None or key(bound) > key(best):
            best = bound
    assert best is not None
    return best
