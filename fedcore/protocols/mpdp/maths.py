"""The numerics of mpdp (digest 000): MP_Server's perturbation, LMT, recovery, noise, fixed point.

Everything here is a small pure function over numpy arrays (torch only for the client's
vector-Jacobian products), so each step is tested on its own. Notation follows the digest:
an L-layer bias-free ReLU MLP W^(1..L) with widths n_0..n_L is expanded to 2L-1 layers with
identity "transitional" layers; the server multiplies the odd layers by R (built from positive
vectors r^(l), s^(l)), turns the transitional layers into diag(1/(r^(l) s^(l))) and adds the
output shift r_out to every column of the last layer. The perturbed net then outputs the true
output plus alpha * r_out, where alpha is the sum of the activations feeding the last layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedcore.errors import ProtocolError
from fedcore.protocols import _relu_mlp

FRACTION_BITS = 32
"""Fractional bits of the fixed-point encoding of masked correction tensors (Hardened mode)."""

HARDENED_SCALE_MAX = 2.0
"""Hardened mode draws every r_i^(l), s_i^(l) log-uniformly in [1, HARDENED_SCALE_MAX]."""

BOUND_STEP = 2.0**0.25
"""Scale bounds sent to clients are rounded up to a power of this (they leak less that way)."""


# ------------------------------------------------------------------------------ samplers


def dn_star_1(rng: np.random.Generator, size: int) -> np.ndarray:
    """|DN*(1)| of the digest's Thm 3, exactly: sqrt(Gamma(3/2, 1)); strictly positive."""
    return np.sqrt(rng.gamma(1.5, 1.0, size=size))


def dn_star_pair_r(rng: np.random.Generator, size: int) -> np.ndarray:
    """The r half of an exact |DN*(1)| split: 2^(1/4) Gamma(3/4)^(1/4) (digest §2.2, G4)."""
    return 2.0**0.25 * rng.gamma(0.75, 1.0, size=size) ** 0.25


def dn_star_pair_s(rng: np.random.Generator, size: int) -> np.ndarray:
    """The s half: 2^(1/4) Gamma(5/4)^(1/4); r * s has the law of sqrt(Gamma(3/2))."""
    return 2.0**0.25 * rng.gamma(1.25, 1.0, size=size) ** 0.25


def log_uniform(rng: np.random.Generator, size: int, high: float) -> np.ndarray:
    """Log-uniform draws in [1, high] (Hardened mode's server noise: positive and >= 1)."""
    return np.exp2(rng.uniform(0.0, math.log2(high), size=size))


def uniform_open(bits: np.ndarray) -> np.ndarray:
    """Turns uint64 words into floats uniform in (0, 1) (53 bits, never 0 or 1)."""
    uniform = (bits >> np.uint64(11)).astype(np.float64)
    uniform += 0.5
    uniform *= 2.0**-53
    return uniform


def dn_from_bits(bits: np.ndarray, std: float) -> np.ndarray:
    """DN(std, 1) of Thm 3 = beta * sqrt(2) * std * U: a random sign times a uniform magnitude.

    One uint64 word per draw: its top bit is the sign, its low 53 bits the uniform.
    """
    sign = np.where((bits >> np.uint64(63)) == 1, -1.0, 1.0)
    low = bits & np.uint64((1 << 53) - 1)
    magnitude = (low.astype(np.float64) + 0.5) * 2.0**-53
    return sign * (math.sqrt(2.0) * std) * magnitude


def gaussian_from_bits(bits: np.ndarray, std: float) -> np.ndarray:
    """N(0, std^2) draws by Box-Muller; needs two uint64 words per draw (len(bits) even)."""
    half = len(bits) // 2
    u1 = uniform_open(bits[:half])
    u2 = uniform_open(bits[half : 2 * half])
    return std * np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)


NOISE_BLOCK = 1024
"""Keystream words per block of a client's noise, one draw per word. Hardened's Box-Muller
turns each block's first half into radii and its second half into angles. Blocks a multiple
of 64 long keep every draw's arithmetic in the same vector lanes wherever its row sits in a
batch, so two clients drawing one pair's row in different batches get the same bits."""


def noise_words(size: int) -> int:
    """The keystream words noise on ``size`` entries takes: ``size`` rounded up to blocks."""
    return -(-size // NOISE_BLOCK) * NOISE_BLOCK


def unit_noise(bits: np.ndarray, *, gaussian: bool) -> np.ndarray:
    """Unit-scale draws, one per word, from rows of whole ``NOISE_BLOCK``-word blocks.

    Args:
        bits: keystream words, shape (..., k * NOISE_BLOCK).
        gaussian: N(0, 1) by Box-Muller within each block (Hardened); otherwise DN(1, 1) of
            Thm 3, a random sign times sqrt(2) U (Faithful).
    """
    if bits.shape[-1] % NOISE_BLOCK:
        raise ValueError(f"Noise words come in blocks of {NOISE_BLOCK}, not {bits.shape[-1]}.")
    if not gaussian:
        return dn_from_bits(bits, 1.0)
    blocks = bits.reshape(*bits.shape[:-1], -1, NOISE_BLOCK)
    return _box_muller(blocks).reshape(bits.shape)


def _box_muller(bits: np.ndarray) -> np.ndarray:
    """Standard normals from words (..., 2h): radii from [..., :h], angles from [..., h:]."""
    half = bits.shape[-1] // 2
    uniform = torch.from_numpy(uniform_open(bits))
    radius = uniform[..., :half].log().mul_(-2.0).sqrt_()
    angle = uniform[..., half : 2 * half].mul(2.0 * math.pi)
    draws = torch.empty(uniform.shape, dtype=torch.float64)
    # torch's vectorised log, cos and sin are several times faster than numpy's here.
    torch.mul(radius, torch.cos(angle), out=draws[..., :half])
    torch.mul(radius, angle.sin_(), out=draws[..., half : 2 * half])
    return draws.numpy()


# --------------------------------------------------------------------------- MP_Server


@dataclass(frozen=True)
class Perturbation:
    """One round's server secrets (never sent): positive r^(l), s^(l) and the output shift.

    Attributes:
        r: r^(l) for l = 1..L-1, each of length n_l, strictly positive.
        s: s^(l) for l = 1..L-1, each of length n_l, strictly positive.
        shift: r = gamma o r^(a), the output shift vector (length n_L).
    """

    r: tuple[np.ndarray, ...]
    s: tuple[np.ndarray, ...]
    shift: np.ndarray

    @property
    def upsilon(self) -> float:
        """upsilon = r^T r, the squared norm of the output shift."""
        return float(self.shift @ self.shift)

    def multipliers(self) -> list[np.ndarray]:
        """R^(2l-1) for l = 1..L (Eq. 14), broadcastable to the layer's shape n_l x n_(l-1).

        The first is a column (r^(1) per row), the last a row (s^(L-1) per column), the inner
        ones the outer products r^(l) s^(l-1)^T.
        """
        layers = len(self.r) + 1
        result = []
        for layer in range(layers):
            rows = self.r[layer] if layer < layers - 1 else None
            cols = self.s[layer - 1] if layer > 0 else None
            if rows is not None and cols is not None:
                result.append(np.outer(rows, cols))
            elif rows is not None:
                result.append(rows[:, None])
            else:
                assert cols is not None
                result.append(cols[None, :])
        return result

    def transitional(self) -> list[np.ndarray]:
        """The diagonals of the transitional layers: 1/(r^(l) o s^(l)), l = 1..L-1."""
        return [1.0 / (r * s) for r, s in zip(self.r, self.s, strict=True)]


def draw_perturbation(
    rng: np.random.Generator, widths: Sequence[int], *, hardened: bool, shift_std: float
) -> Perturbation:
    """Draws one round's MP_Server secrets for an MLP of ``widths`` = (n_0, ..., n_L).

    Faithful (Eq. 13 with the digest's G3/G4 resolutions): r^(1), s^(L-1) ~ |DN*(1)|; the
    inner r^(l), s^(l) are the exact pair whose products r_i^(l) s_j^(l-1) have |DN*(1)|'s law,
    so every entry of R has the law of sqrt(Gamma(3/2)) and R o DN(sigma, 1) ~ N(0, sigma^2).
    Hardened: every factor log-uniform in [1, HARDENED_SCALE_MAX], so every R entry is >= 1.
    The output shift is N(0, shift_std^2) per entry in both modes (the paper leaves it open).

    Raises:
        ProtocolError: the MLP has no hidden layer (nothing can absorb the scales).
    """
    layers = len(widths) - 1
    if layers < 2:
        raise ProtocolError("mpdp needs an MLP with at least one hidden layer (spec.model.hidden).")
    hidden = list(widths[1:-1])
    r: list[np.ndarray] = []
    s: list[np.ndarray] = []
    for layer, width in enumerate(hidden, start=1):
        if hardened:
            r.append(log_uniform(rng, width, HARDENED_SCALE_MAX))
            s.append(log_uniform(rng, width, HARDENED_SCALE_MAX))
            continue
        r.append(dn_star_1(rng, width) if layer == 1 else dn_star_pair_r(rng, width))
        s.append(dn_star_1(rng, width) if layer == layers - 1 else dn_star_pair_s(rng, width))
    shift = rng.normal(0.0, shift_std, size=widths[-1])
    return Perturbation(tuple(r), tuple(s), shift)


def perturb(weights: Sequence[np.ndarray], secrets: Perturbation) -> list[np.ndarray]:
    """Eq. 15 on the odd layers: R o W, plus the output shift on every column of the last."""
    result = [multiplier * w for multiplier, w in zip(secrets.multipliers(), weights, strict=True)]
    result[-1] = result[-1] + secrets.shift[:, None]
    return result


def round_up_bound(value: float) -> float:
    """Rounds a positive bound up to a power of BOUND_STEP (a coarse value leaks less)."""
    if value <= 0:
        return 0.0
    return float(BOUND_STEP ** math.ceil(math.log(value, BOUND_STEP) - 1e-12))


def scale_bounds(secrets: Perturbation) -> tuple[list[float], float]:
    """Public upper bounds for the clients' clipping: max R per odd layer and ||r_out||_2."""
    layers = [round_up_bound(float(m.max())) for m in secrets.multipliers()]
    return layers, round_up_bound(math.sqrt(secrets.upsilon))


# --------------------------------------------------------------------------------- LMT


@dataclass
class LocalTerms:
    """What LMT computes on the perturbed model, per odd layer j = 0..L-1.

    Attributes:
        gradient: dL^/dW^(2j+1), the perturbed gradient.
        psi: Psi^(2j+1), shape (n_L, *layer shape): the gradients of the Q_i scalars.
        phi: Phi^(2j+1): the gradient of the P scalar.
        terms: the n_L + 2 scalars [L^, Q_1..Q_nL, P]; the true loss is L^ - r.Q + upsilon P.
        last_row: u = c mean(alpha h), the row that makes up the last layer's Psi:
            Psi^(2L-1)[i] = e_i u^T (Q_i reaches the last layer through its row i only), so an
            upload carries u alone for it; that layer's Phi is 0.
    """

    gradient: list[np.ndarray]
    psi: list[np.ndarray]
    phi: list[np.ndarray]
    terms: np.ndarray
    last_row: np.ndarray

    def scaled(self, factor: float) -> LocalTerms:
        """Returns the terms whose recovery is ``factor`` times this one's (terms unchanged)."""
        return LocalTerms(
            [factor * g for g in self.gradient],
            [factor * p for p in self.psi],
            [factor * p for p in self.phi],
            self.terms,
            factor * self.last_row,
        )


def last_layer_psi(row: np.ndarray, outputs: int) -> np.ndarray:
    """Psi of the last layer from its row u: entry [i, i, :] is u, every other row is 0."""
    psi = np.zeros((outputs, outputs, row.shape[0]), dtype=row.dtype)
    psi[np.arange(outputs), np.arange(outputs)] = row
    return psi


def local_terms(
    odd: Sequence[np.ndarray], diagonals: Sequence[np.ndarray], x: torch.Tensor, y: torch.Tensor
) -> LocalTerms:
    """LMT with the efficient form (digest §2.4): n_L + 2 vector-Jacobian products, batched.

    The loss is torch's ``mse_loss`` (mean over examples and outputs), as the clients' training
    loss; with c = 2 / n_L the scalars are L^ = mse(y^, t), Q_i = c mean_s(alpha_s (y^_si -
    t_si)) and P = c mean_s(alpha_s^2 / 2), and the true loss is L^ - r.Q + upsilon P as a
    function of the perturbed weights, so the true gradient is R o (dL^ - r.dQ + upsilon dP).
    The n_L + 2 reverse passes go back through the hidden layers together
    (``_relu_mlp.noise_term_gradients`` with one cell per output).

    Args:
        odd: the perturbed odd layers, float64.
        diagonals: the transitional layers' diagonals.
        x: the examples, any shape (n, ...), flattened here.
        y: the one-hot targets, (n, n_L).
    """
    device = x.device
    params = [_relu_mlp.as_tensor(w, device) for w in odd]
    diags = [_relu_mlp.as_tensor(d, device) for d in diagonals]
    with torch.no_grad():
        passed = _relu_mlp.forward(params, x.to(torch.float64), diags)
        found = _relu_mlp.noise_term_gradients(params, passed, y.to(torch.float64), None)
    outputs = int(odd[-1].shape[0])
    last_row = _numpy(found.cell_row)
    gradient = [_numpy(g) for g in found.loss_grads]
    psi = [*(_numpy(g) for g in found.cell_grads), last_layer_psi(last_row, outputs)]
    phi = [*(_numpy(g) for g in found.beta_grads), np.zeros(odd[-1].shape)]
    terms = _numpy(
        torch.cat([found.loss.reshape(1), found.cell_values, found.beta_value.reshape(1)])
    )
    return LocalTerms(gradient, psi, phi, terms, last_row)


def with_gradient(terms: LocalTerms, gradient: Sequence[np.ndarray]) -> LocalTerms:
    """Terms whose recovery is ``R o gradient``: ``gradient`` per odd layer (reshaped to its
    shape), every correction and scalar zero. A client that sends them contributes a
    gradient it chose (the canary audit's probes do), clipped and noised as any other."""
    if len(gradient) != len(terms.gradient):
        raise ValueError(f"Expected {len(terms.gradient)} layers' gradients, got {len(gradient)}.")
    return LocalTerms(
        [
            np.asarray(g, np.float64).reshape(t.shape)
            for g, t in zip(gradient, terms.gradient, strict=True)
        ],
        [np.zeros_like(p) for p in terms.psi],
        [np.zeros_like(p) for p in terms.phi],
        np.zeros_like(terms.terms),
        np.zeros_like(terms.last_row),
    )


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """A float64 numpy array on the CPU (a view when the tensor already is one)."""
    return tensor.detach().to("cpu", torch.float64).numpy()


# ------------------------------------------------------------------------- clipping, MU


def norm_bound(terms: LocalTerms, layer_bounds: Sequence[float], shift_bound: float) -> float:
    """An upper bound on the L2 norm of what ``terms`` recover to, from public bounds only.

    Per odd layer, ||R o (G - r.Psi + upsilon Phi)|| <= max(R) (||G|| + ||r|| s(Psi) +
    ||r||^2 ||Phi||), where s(Psi) is the largest singular value of Psi seen as the linear map
    r -> r.Psi; so scaling every tensor by min(1, B / bound) bounds the recovered contribution
    by B knowing only the bounds on R and ||r||, never R or r.
    """
    total = 0.0
    for g, psi, phi, m in zip(terms.gradient, terms.psi, terms.phi, layer_bounds, strict=True):
        flat = psi.reshape(psi.shape[0], -1)
        gram = flat @ flat.T
        spectral = math.sqrt(max(float(np.linalg.eigvalsh(gram)[-1]), 0.0))
        layer = np.linalg.norm(g) + shift_bound * spectral + shift_bound**2 * np.linalg.norm(phi)
        total += (m * float(layer)) ** 2
    return math.sqrt(total)


def recover(
    gradient: Sequence[np.ndarray],
    psi: Sequence[np.ndarray],
    phi: Sequence[np.ndarray],
    secrets: Perturbation,
) -> list[np.ndarray]:
    """Eq. 22: R o (G - r^T Psi + upsilon Phi) per odd layer."""
    upsilon = secrets.upsilon
    return [
        multiplier * (g - np.tensordot(secrets.shift, p, axes=1) + upsilon * f)
        for multiplier, g, p, f in zip(secrets.multipliers(), gradient, psi, phi, strict=True)
    ]


def recover_loss(terms: np.ndarray, secrets: Perturbation) -> float:
    """The true loss from the scalars: L^ - r.Q + upsilon P."""
    outputs = len(secrets.shift)
    return float(
        terms[0] - secrets.shift @ terms[1 : 1 + outputs] + secrets.upsilon * terms[1 + outputs]
    )


# ------------------------------------------------------------------------- fixed point


def encode_fixed(values: np.ndarray, *, parties: int) -> np.ndarray:
    """Encodes floats as two's-complement fixed point in Z_(2^64) (FRACTION_BITS fraction bits).

    Args:
        values: the floats to encode.
        parties: how many such encodings will be summed; each value must leave room for them.

    Raises:
        ProtocolError: a value is not finite or the sum of ``parties`` of them could overflow.
    """
    limit = 2.0 ** (62 - FRACTION_BITS) / max(parties, 1)
    scaled = np.ldexp(values.astype(np.float64), FRACTION_BITS)
    # One pass checks both: NaN fails every comparison and infinity fails this one.
    if scaled.size and not float(np.abs(scaled).max()) < math.ldexp(limit, FRACTION_BITS):
        raise ProtocolError(
            f"A correction value is not finite or reaches {limit:.3g}, beyond what the "
            f"{FRACTION_BITS}-bit fixed point of {parties} clients can sum without overflow."
        )
    return np.rint(scaled, out=scaled).astype(np.int64).view(np.uint64)


def decode_fixed(total: np.ndarray) -> np.ndarray:
    """Decodes a sum of ``encode_fixed`` words (mod 2^64) back to floats."""
    return np.ldexp(total.view(np.int64).astype(np.float64), -FRACTION_BITS)
