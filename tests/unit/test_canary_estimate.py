"""The canary audit's statistics, checked against closed forms, an independent numerical
integration, dp_accounting, and seeded simulations whose true epsilon is known."""

from __future__ import annotations

import itertools
import math
from typing import Any

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate
from scipy.optimize import brentq
from scipy.special import expit, logit
from scipy.stats import binom, norm

from fedcore.audit.canary import (
    gaussian_hockey_stick,
    gaussian_pair_epsilon,
    one_run_epsilon,
    one_run_lower_bound,
    one_run_p_value,
    one_shot_estimate,
)

MUS = (0.1, 0.5, 1.0, 2.0, 4.0, 8.0)
DELTAS = (1e-2, 1e-5, 1e-9)


def analytic_gaussian_epsilon(mu: float, delta: float) -> float:
    """epsilon(delta) of the Gaussian mechanism with sensitivity/sigma = mu, solved here on
    Balle & Wang (ICML 2018): delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)."""

    def excess(eps: float) -> float:
        return float(
            norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta
        )

    if excess(0.0) <= 0.0:
        return 0.0
    hi = 1.0
    while excess(hi) > 0.0:
        hi *= 2.0
    return float(brentq(excess, 0.0, hi, xtol=1e-14))


def integrated_hockey_stick(mu_p: float, s_p: float, mu_q: float, s_q: float, eps: float) -> float:
    """∫ max(0, p - e^eps q) by quadrature, over pieces between sign changes found on a grid."""

    def gap(x: Any) -> Any:
        return norm.pdf(x, mu_p, s_p) - math.exp(eps) * norm.pdf(x, mu_q, s_q)

    lo = min(mu_p - 40 * s_p, mu_q - 40 * s_q)
    hi = max(mu_p + 40 * s_p, mu_q + 40 * s_q)
    grid = np.linspace(lo, hi, 400_001)
    signs = np.sign(gap(grid))
    flips = np.flatnonzero(signs[:-1] != signs[1:])
    edges = [lo, *(brentq(gap, grid[i], grid[i + 1], xtol=1e-15) for i in flips), hi]
    total = 0.0
    for a, b in itertools.pairwise(edges):
        if gap(0.5 * (a + b)) > 0:
            total += integrate.quad(gap, a, b, epsabs=1e-15, epsrel=1e-13, limit=500)[0]
    return total


# ------------------------------------------------------------------- two Gaussians' epsilon


@pytest.mark.parametrize("mu", MUS)
@pytest.mark.parametrize("delta", DELTAS)
def test_equal_variances_are_the_analytic_gaussian_mechanism(mu: float, delta: float) -> None:
    expected = analytic_gaussian_epsilon(mu, delta)
    assert abs(gaussian_pair_epsilon(0.0, 1.0, mu, 1.0, delta) - expected) <= 1e-9
    assert abs(gaussian_pair_epsilon(3.0, 1.0, 3.0 - mu, 1.0, delta) - expected) <= 1e-9
    # Only mu = separation / sigma matters.
    assert abs(gaussian_pair_epsilon(-1.0, 2.5, -1.0 + 2.5 * mu, 2.5, delta) - expected) <= 1e-9


@pytest.mark.parametrize("mu", (0.5, 2.0))
@pytest.mark.parametrize("delta", (1e-3, 1e-6))
def test_agrees_with_dp_accounting(mu: float, delta: float) -> None:
    ours = gaussian_pair_epsilon(0.0, 1.0, mu, 1.0, delta)
    # dp_accounting's analytic Gaussian (sigma for sensitivity 1): the same number.
    assert abs(dp_accounting.get_epsilon_gaussian(1.0 / mu, delta) - ours) <= 1e-9
    # Its PLD discretises pessimistically: at most a hair below, and above by < 1e-6.
    pld = privacy_loss_distribution.from_gaussian_mechanism(1.0, sensitivity=mu)
    assert -1e-8 <= pld.get_epsilon_for_delta(delta) - ours <= 1e-6


@pytest.mark.parametrize(
    ("mu_p", "s_p", "mu_q", "s_q", "eps"),
    [
        (0.0, 1.0, 1.0, 2.0, 0.0),  # P narrower: S is an interval
        (0.0, 1.0, 1.0, 2.0, 0.5),
        (1.0, 2.0, 0.0, 1.0, 1.0),  # P wider: S is two half-lines
        (1.0, 2.0, 0.0, 1.0, 3.0),
        (0.3, 0.7, -0.2, 0.9, 0.2),
        (0.0, 1.0, 0.0, 1.3, 0.1),  # same mean, only the spread differs
        (2.0, 1.05, 0.0, 0.95, 2.0),
        (0.0, 1.0, 4.0, 1.0001, 1.5),  # nearly equal spreads: one root far away
    ],
)
def test_hockey_stick_closed_form_is_the_integral(
    mu_p: float, s_p: float, mu_q: float, s_q: float, eps: float
) -> None:
    closed = gaussian_hockey_stick(mu_p, s_p, mu_q, s_q, eps)
    numeric = integrated_hockey_stick(mu_p, s_p, mu_q, s_q, eps)
    assert abs(closed - numeric) <= 1e-9
    assert closed == pytest.approx(numeric, rel=1e-6, abs=1e-12)


def test_hockey_stick_is_zero_where_the_narrow_one_never_dominates() -> None:
    # N(0, 1) against N(0, 2^2): log p/q <= log 2 everywhere, so H vanishes past it.
    assert gaussian_hockey_stick(0.0, 1.0, 0.0, 2.0, math.log(2.0) + 1e-9) == 0.0
    assert gaussian_hockey_stick(0.0, 1.0, 0.0, 2.0, math.log(2.0) - 0.1) > 0.0


def test_unequal_variances_epsilon_solves_the_hockey_stick() -> None:
    delta = 1e-5
    eps = gaussian_pair_epsilon(0.0, 1.02, 1.0, 0.97, delta)
    both = max(
        gaussian_hockey_stick(0.0, 1.02, 1.0, 0.97, eps),
        gaussian_hockey_stick(1.0, 0.97, 0.0, 1.02, eps),
    )
    assert both == pytest.approx(delta, rel=1e-9)
    # Unequal spreads make the pair easier to tell apart far out: more than equal spreads.
    assert eps > gaussian_pair_epsilon(0.0, 1.0, 1.0, 1.0, delta) + 0.5


def test_degenerate_pairs() -> None:
    assert gaussian_pair_epsilon(0.0, 1.0, 0.0, 1.0, 1e-5) == 0.0
    assert gaussian_pair_epsilon(0.0, 0.0, 0.0, 1.0, 1e-5) == math.inf
    assert gaussian_pair_epsilon(0.0, 1.0, 1.0, 0.0, 1e-5) == math.inf
    assert gaussian_pair_epsilon(2.0, 0.0, 2.0, 0.0, 1e-5) == 0.0
    assert gaussian_pair_epsilon(2.0, 0.0, 3.0, 0.0, 1e-5) == math.inf
    # A tiny std is distinguishable far out: finite but huge, and past 2^40 reported as inf.
    assert 1e6 < gaussian_pair_epsilon(0.0, 1e-3, 0.0, 1.0, 1e-5) < math.inf
    assert gaussian_pair_epsilon(0.0, 1e-9, 0.0, 1.0, 1e-5) == math.inf
    # delta at or above the total variation distance: epsilon 0.
    tv = 2 * norm.cdf(0.05) - 1
    assert gaussian_pair_epsilon(0.0, 1.0, 0.1, 1.0, tv * 1.001) == 0.0
    assert gaussian_pair_epsilon(0.0, 1.0, 0.1, 1.0, tv * 0.999) > 0.0


finite = st.floats(-5.0, 5.0, allow_nan=False)
spread = st.floats(0.05, 5.0, allow_nan=False)
small_delta = st.floats(1e-10, 0.5, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(mu0=finite, mu1=finite, sigma=spread, eps=st.floats(0.0, 20.0), delta=small_delta)
def test_equal_variances_are_symmetric(
    mu0: float, mu1: float, sigma: float, eps: float, delta: float
) -> None:
    forward = gaussian_hockey_stick(mu0, sigma, mu1, sigma, eps)
    backward = gaussian_hockey_stick(mu1, sigma, mu0, sigma, eps)
    assert forward == pytest.approx(backward, rel=1e-9, abs=1e-15)
    a = gaussian_pair_epsilon(mu0, sigma, mu1, sigma, delta)
    assert a == pytest.approx(gaussian_pair_epsilon(mu1, sigma, mu0, sigma, delta), abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    near=st.floats(0.0, 6.0),
    further=st.floats(0.0, 6.0),
    sigma=spread,
    delta=small_delta,
)
def test_epsilon_grows_with_separation(
    near: float, further: float, sigma: float, delta: float
) -> None:
    near, further = sorted((near, further))
    eps_near = gaussian_pair_epsilon(0.0, sigma, near * sigma, sigma, delta)
    eps_far = gaussian_pair_epsilon(0.0, sigma, further * sigma, sigma, delta)
    assert eps_near <= eps_far + 1e-9


# ------------------------------------------------------------------------ one-shot estimate


def gaussian_mechanism_scores(seed: int, n: int, mu: float) -> tuple[np.ndarray, np.ndarray]:
    """n inserted canaries' scores from N(mu, 1) and n held-out ones from N(0, 1)."""
    rng = np.random.default_rng(seed)
    return rng.normal(mu, 1.0, n), rng.normal(0.0, 1.0, n)


@pytest.mark.parametrize("seed", (0, 1, 2))
def test_one_shot_covers_the_true_epsilon(seed: int) -> None:
    delta, mu = 1e-5, 1.0
    truth = analytic_gaussian_epsilon(mu, delta)  # 4.377
    inserted, held_out = gaussian_mechanism_scores(seed, 1000, mu)
    estimate = one_shot_estimate(inserted, held_out, delta, seed=seed)
    assert estimate.low <= truth <= estimate.high
    # Over 300 seeds at this size the estimate's error had mean +0.59, sd 0.52, max 2.33.
    assert abs(estimate.epsilon - truth) <= 2.5


def test_one_shot_converges_with_more_canaries() -> None:
    delta, mu = 1e-5, 1.0
    inserted, held_out = gaussian_mechanism_scores(7, 20_000, mu)
    estimate = one_shot_estimate(inserted, held_out, delta, resamples=20)
    # Over 300 seeds at 20000 per group: error mean +0.13, sd 0.10, max 0.49.
    assert abs(estimate.epsilon - analytic_gaussian_epsilon(mu, delta)) <= 0.6


def test_one_shot_reports_its_fits_and_is_deterministic() -> None:
    inserted, held_out = gaussian_mechanism_scores(3, 200, 2.0)
    first = one_shot_estimate(inserted, held_out, 1e-3, confidence=0.9, resamples=200, seed=5)
    again = one_shot_estimate(inserted, held_out, 1e-3, confidence=0.9, resamples=200, seed=5)
    other = one_shot_estimate(inserted, held_out, 1e-3, confidence=0.9, resamples=200, seed=6)
    assert first == again
    assert (first.low, first.high) != (other.low, other.high)
    assert first.epsilon == other.epsilon
    assert first.inserted == (inserted.mean(), inserted.std(ddof=1))
    assert first.held_out == (held_out.mean(), held_out.std(ddof=1))
    assert (first.n_inserted, first.n_held_out, first.confidence) == (200, 200, 0.9)
    assert first.epsilon == gaussian_pair_epsilon(*first.held_out, *first.inserted, 1e-3)
    percentile = one_shot_estimate(
        inserted, held_out, 1e-3, confidence=0.9, resamples=200, seed=5, interval="percentile"
    )
    # basic = 2 * estimate - (the percentile interval, reversed)
    assert first.low == pytest.approx(max(0.0, 2 * first.epsilon - percentile.high))
    assert first.high == pytest.approx(2 * first.epsilon - percentile.low)


def test_one_shot_of_indistinguishable_groups_is_small() -> None:
    rng = np.random.default_rng(11)
    estimate = one_shot_estimate(rng.normal(size=2000), rng.normal(size=2000), 1e-2)
    assert estimate.low == 0.0
    assert estimate.epsilon < 0.5


# ---------------------------------------------------------------------------- one-run bound


def theorem_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """Steinke et al.'s bound written out literally: f(v) + 2 m delta max_{i=1..m} ..."""

    def f(k: int) -> float:
        return 1.0 if k <= 0 else float(binom.sf(k - 1, r, expit(eps)))

    alpha = max((f(v - i) - f(v)) / i for i in range(1, m + 1))
    return min(1.0, f(v) + 2 * m * delta * alpha)


@pytest.mark.parametrize(
    ("m", "r", "v", "eps", "delta"),
    [
        (50, 20, 15, 0.5, 1e-3),
        (50, 50, 40, 1.0, 1e-4),
        (100, 30, 30, 2.0, 1e-5),
        (100, 100, 62, 0.3, 1e-3),
        (40, 10, 0, 1.0, 1e-2),
        (200, 60, 45, 0.0, 1e-4),
    ],
)
def test_p_value_is_the_theorem(m: int, r: int, v: int, eps: float, delta: float) -> None:
    expected = theorem_p_value(m, r, v, eps, delta)
    assert one_run_p_value(m, r, v, eps, delta) == pytest.approx(expected, rel=1e-9, abs=1e-14)


def test_pure_dp_p_value_is_a_binomial_tail() -> None:
    assert one_run_p_value(100, 40, 30, 1.0, 0.0) == pytest.approx(binom.sf(29, 40, expit(1.0)))


@pytest.mark.parametrize("r", (10, 50, 100, 1000))
def test_all_correct_has_a_closed_form(r: int) -> None:
    # delta = 0, v = r: the p-value is q^r, so the bound is logit(beta^(1/r)).
    beta = 0.05
    assert one_run_epsilon(r, r, r, 0.0, beta) == pytest.approx(logit(beta ** (1 / r)), abs=1e-9)
    # A delta > 0 only weakens it.
    assert one_run_epsilon(r, r, r, 1e-6, beta) <= one_run_epsilon(r, r, r, 0.0, beta)


def test_perfect_scores_reach_the_closed_form_with_bonferroni() -> None:
    flags = np.repeat([True, False], 100)
    scores = np.where(flags, 5.0, -5.0) + np.linspace(0.0, 0.1, 200)
    bound = one_run_lower_bound(scores, flags, 0.0, confidence=0.95, guess_counts=[20, 50, 100])
    assert (bound.guesses, bound.correct, bound.k_plus, bound.k_minus) == (100, 100, 50, 50)
    assert (bound.canaries, bound.candidates) == (200, 3)
    assert bound.epsilon == pytest.approx(logit((0.05 / 3) ** (1 / 100)), abs=1e-9)


@pytest.mark.parametrize("eps_true", (0.5, 1.0, 2.0))
def test_single_test_has_its_size_under_randomized_response(eps_true: float) -> None:
    # Randomized response with r = m guesses: W ~ Binomial(m, e^eps/(1+e^eps)) exactly, the
    # worst case of the theorem. So P[bound > eps_true] is computable exactly, and must be
    # at most beta (validity) and not far below it (the bound is tight here).
    m, beta = 400, 0.05
    v = np.arange(m + 1)
    bounds = np.array([one_run_epsilon(m, m, int(k), 0.0, beta) for k in v])
    size = binom.pmf(v, m, expit(eps_true))[bounds > eps_true].sum()
    assert 0.7 * beta <= size <= beta


def test_p_value_grows_with_epsilon() -> None:
    # The search on epsilon relies on it (as the paper's does).
    eps = np.linspace(0.0, 10.0, 401)
    for m, r, v, delta in [(1000, 100, 70, 1e-5), (1000, 1000, 600, 1e-6), (100, 100, 90, 1e-3)]:
        p = [one_run_p_value(m, r, v, e, delta) for e in eps]
        assert np.all(np.diff(p) >= -1e-15)


@pytest.mark.parametrize(("m", "r", "delta"), [(1000, 100, 0.0), (1000, 300, 1e-5), (60, 60, 1e-3)])
def test_bound_grows_with_correct_guesses(m: int, r: int, delta: float) -> None:
    bounds = [one_run_epsilon(m, r, v, delta, 0.05) for v in range(r + 1)]
    assert np.all(np.diff(bounds) >= 0.0)
    assert bounds[0] == 0.0
    assert bounds[-1] > 0.0


def coin_flips(rng: np.random.Generator, m: int) -> np.ndarray:
    return rng.random(m) < 0.5


TRIALS = 200
ALLOWED_ABOVE = int(0.05 * TRIALS + 3 * math.sqrt(TRIALS * 0.05 * 0.95))
"""At 95% confidence at most 5% of bounds may pass the truth; 3 binomial sds of slack: 19."""


def test_bound_stays_below_the_gaussian_mechanisms_epsilon() -> None:
    delta, mu, m = 1e-5, 2.0, 1000
    truth = analytic_gaussian_epsilon(mu, delta)  # 10.0 (the bound reaches ~3 here)
    above, bounds = 0, []
    for seed in range(TRIALS):
        rng = np.random.default_rng(seed)
        flags = coin_flips(rng, m)
        scores = rng.normal(0.0, 1.0, m) + mu * flags
        bound = one_run_lower_bound(scores, flags, delta)
        above += bound.epsilon > truth
        bounds.append(bound.epsilon)
    assert above <= ALLOWED_ABOVE
    assert np.median(bounds) > 1.0  # and it does detect the leak


def test_bound_stays_below_randomized_responses_epsilon() -> None:
    # Scores that are randomized response of the flags at eps_true (pure DP): the case where
    # the bound is tightest, so where an invalid bound would show.
    eps_true, m = 1.0, 1000
    above, bounds = 0, []
    for seed in range(TRIALS):
        rng = np.random.default_rng(10_000 + seed)
        flags = coin_flips(rng, m)
        honest = rng.random(m) < expit(eps_true)
        scores = np.where(flags == honest, 1.0, -1.0) + 1e-3 * rng.random(m)
        bound = one_run_lower_bound(scores, flags, 0.0)
        above += bound.epsilon > eps_true
        bounds.append(bound.epsilon)
    assert above <= ALLOWED_ABOVE
    assert np.median(bounds) > 0.5 * eps_true


def test_bound_of_unrelated_scores_is_zero() -> None:
    positive = 0
    for seed in range(100):
        rng = np.random.default_rng(20_000 + seed)
        flags = coin_flips(rng, 500)
        bound = one_run_lower_bound(rng.normal(size=500), flags, 1e-5)
        positive += bound.epsilon > 0
    # epsilon = 0 is true here, so a positive bound is a false refutation: at most 5% of
    # runs, plus 3 binomial sds of slack.
    assert positive <= 5 + 3 * math.sqrt(100 * 0.05 * 0.95)


# ----------------------------------------------------------------------------------- errors


GOOD = np.linspace(0.0, 1.0, 10)
FLAGS = np.arange(10) % 2 == 0


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: one_shot_estimate([1.0], GOOD, 1e-5), "inserted"),
        (lambda: one_shot_estimate(GOOD, [2.0], 1e-5), "held_out"),
        (lambda: one_shot_estimate([1.0, np.nan, 2.0], GOOD, 1e-5), "inserted"),
        (lambda: one_shot_estimate(GOOD, [1.0, np.inf], 1e-5), "held_out"),
        (lambda: one_shot_estimate(GOOD, GOOD, 0.0), "delta"),
        (lambda: one_shot_estimate(GOOD, GOOD, 1.0), "delta"),
        (lambda: one_shot_estimate(GOOD, GOOD, 1e-5, confidence=1.0), "confidence"),
        (lambda: one_shot_estimate(GOOD, GOOD, 1e-5, confidence=0.0), "confidence"),
        (lambda: one_shot_estimate(GOOD, GOOD, 1e-5, resamples=0), "resamples"),
        (lambda: one_shot_estimate(GOOD, GOOD, 1e-5, interval="bca"), "interval"),  # type: ignore[arg-type]
        (lambda: gaussian_pair_epsilon(0.0, -1.0, 1.0, 1.0, 1e-5), "sigma0"),
        (lambda: gaussian_pair_epsilon(0.0, 1.0, np.nan, 1.0, 1e-5), "mu1"),
        (lambda: gaussian_pair_epsilon(0.0, 1.0, 1.0, 1.0, 0.0), "delta"),
        (lambda: gaussian_hockey_stick(0.0, 1.0, 1.0, 1.0, -0.5), "epsilon"),
        (lambda: one_run_lower_bound(GOOD, FLAGS[:9], 1e-5), "inserted"),
        (lambda: one_run_lower_bound(np.where(FLAGS, np.nan, 0.0), FLAGS, 1e-5), "scores"),
        (lambda: one_run_lower_bound(GOOD, np.arange(10) == 0, 1e-5), "inserted"),
        (lambda: one_run_lower_bound(GOOD, np.arange(10) > 0, 1e-5), "inserted"),
        (lambda: one_run_lower_bound(GOOD, np.arange(10) % 3, 1e-5), "inserted"),
        (lambda: one_run_lower_bound(GOOD, FLAGS, 1.0), "delta"),
        (lambda: one_run_lower_bound(GOOD, FLAGS, -1e-5), "delta"),
        (lambda: one_run_lower_bound(GOOD, FLAGS, 1e-5, confidence=1.5), "confidence"),
        (lambda: one_run_lower_bound(GOOD, FLAGS, 1e-5, guess_counts=[0]), "guess_counts"),
        (lambda: one_run_lower_bound(GOOD, FLAGS, 1e-5, guess_counts=[11]), "guess_counts"),
        (lambda: one_run_lower_bound(GOOD, FLAGS, 1e-5, guess_counts=[]), "guess_counts"),
        (lambda: one_run_epsilon(10, 5, 6, 1e-5, 0.05), "v"),
        (lambda: one_run_epsilon(10, 11, 6, 1e-5, 0.05), "r"),
        (lambda: one_run_epsilon(10, 5, 3, 1e-5, 1.0), "beta"),
        (lambda: one_run_p_value(10, 5, 3, -1.0, 1e-5), "epsilon"),
    ],
)
def test_bad_input_is_refused_by_name(call: Any, name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        call()
