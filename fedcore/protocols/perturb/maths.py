"""The maths of ``perturb`` (digest 001): secrets, perturbation, the m+2 gradients, recovery.

Notation follows the digest (§2.1-2.3): a bias-free ReLU MLP with L weight layers W^(l) of shape
(n_l, n_{l-1}); hidden scales r^(l) > 0 (secret); the public output noise r^(a) and the public
partition of the n_L outputs into m cells; one secret scale gamma_s per cell; r = gamma o r^(a)
and v = r.r. Server-side functions work on numpy float64 arrays; the client-side one on torch
tensors (autograd). Layers are lists in input-to-output order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedcore.protocols import _relu_mlp


@dataclass
class RoundSecrets:
    """One round's noise (digest 001, §2.2 step S1); drawn fresh every round.

    Attributes:
        input_width: n_0, the number of inputs of the first layer.
        hidden_scales: r^(l) for l = 1..L-1, each of shape (n_l,), strictly positive. Secret.
        cell_scales: gamma_s for s = 1..m, shape (m,), never 0. Secret.
        output_noise: r^(a), shape (n_L,), pairwise distinct, never 0. Public: broadcast.
        cell_of_output: the cell s(i) of each output i, shape (n_L,), every cell in 0..m-1
            used. Public: broadcast.
    """

    input_width: int
    hidden_scales: list[np.ndarray]
    cell_scales: np.ndarray
    output_noise: np.ndarray
    cell_of_output: np.ndarray

    @property
    def cells(self) -> int:
        """m, the number of cells of the output partition."""
        return int(self.cell_scales.shape[0])

    def output_shift(self) -> np.ndarray:
        """Returns r = gamma o r^(a): each output moves by alpha * r_i (Theorem 1)."""
        return self.cell_scales[self.cell_of_output] * self.output_noise

    def shift_norm_sq(self) -> float:
        """Returns v = r.r."""
        shift = self.output_shift()
        return float(shift @ shift)

    def scale_factors(self) -> list[np.ndarray]:
        """Returns R^(l) for l = 1..L (Eq. 8): r^(l)_i / r^(l-1)_j, with r^(0) = r^(L) = 1."""
        outer = [*self.hidden_scales, np.ones(self.output_noise.shape[0])]
        inner = [np.ones(self.input_width), *self.hidden_scales]
        return [np.outer(rows, 1.0 / columns) for rows, columns in zip(outer, inner, strict=True)]

    def zeroise(self) -> None:
        """Overwrites every secret array with zeros (the round is over)."""
        for array in (*self.hidden_scales, self.cell_scales, self.output_noise):
            array.fill(0.0)


def log_uniform(rng: np.random.Generator, size: int, spread: float) -> np.ndarray:
    """Returns ``size`` draws from the log-uniform distribution on [1/spread, spread].

    Raises:
        ValueError: ``spread`` is not finite and above 1.
    """
    if not (math.isfinite(spread) and spread > 1):
        raise ValueError(f"The spread of a log-uniform draw must be above 1, got {spread}.")
    bound = math.log(spread)
    return np.exp(rng.uniform(-bound, bound, size=size))


def draw_secrets(
    rng: np.random.Generator,
    widths: Sequence[int],
    *,
    cells: int,
    hidden_spread: float,
    output_spread: float,
) -> RoundSecrets:
    """Draws one round's secrets (digest 001, §2.2 S1 with the ranges of §7 G3 and G7).

    Hidden scales are log-uniform on [1/hidden_spread, hidden_spread], so strictly positive.
    The magnitudes of the output noise and the cell scales are log-uniform on
    [1/output_spread, output_spread] with random signs, so never 0; the output noise is redrawn
    until its entries are pairwise distinct. The partition is a random permutation of the
    outputs cut into ``cells`` nonempty, nearly equal cells.

    Args:
        rng: the server's generator.
        widths: n_0..n_L, the layer widths from the inputs to the outputs (the classes).
        cells: m, from 1 to n_L.
        hidden_spread: h of the hidden scales' range.
        output_spread: b of the output noise's and cell scales' range.

    Raises:
        ValueError: fewer than 2 layers (no hidden layer), a width below 1, or ``cells``
            outside 1..n_L.
    """
    if len(widths) < 3 or any(width < 1 for width in widths):
        raise ValueError(
            f"The perturbation needs at least one hidden layer and positive widths, got {widths}."
        )
    outputs = int(widths[-1])
    if not 1 <= cells <= outputs:
        raise ValueError(f"The number of cells must be from 1 to {outputs}, got {cells}.")
    hidden = [log_uniform(rng, int(width), hidden_spread) for width in widths[1:-1]]
    while True:
        noise = log_uniform(rng, outputs, output_spread) * rng.choice([-1.0, 1.0], size=outputs)
        if np.unique(noise).shape[0] == outputs:
            break
    gamma = log_uniform(rng, cells, output_spread) * rng.choice([-1.0, 1.0], size=cells)
    cell_of_output = np.empty(outputs, dtype=np.int64)
    for cell, members in enumerate(np.array_split(rng.permutation(outputs), cells)):
        cell_of_output[members] = cell
    return RoundSecrets(int(widths[0]), hidden, gamma, noise, cell_of_output)


def perturb_weights(weights: Sequence[np.ndarray], secrets: RoundSecrets) -> list[np.ndarray]:
    """Returns the perturbed model W^^ (Eqs. 7-9): R^(l) o W^(l), plus r 1^T on the last layer.

    Raises:
        ValueError: the layers do not match the secrets' widths.
    """
    factors = secrets.scale_factors()
    _check_layers(weights, factors)
    perturbed = [factor * weight for factor, weight in zip(factors, weights, strict=True)]
    perturbed[-1] = perturbed[-1] + secrets.output_shift()[:, None]
    return perturbed


def recover_gradient(
    perturbed: Sequence[np.ndarray],
    cell_terms: Sequence[Sequence[np.ndarray]],
    beta: Sequence[np.ndarray],
    secrets: RoundSecrets,
) -> list[np.ndarray]:
    """Returns the true gradient R o (G^^ - sum_s gamma_s sigma~_s + v beta) (digest §2.2 A2).

    The formula is linear, so it recovers one client's gradient as well as an aggregate's.

    Args:
        perturbed: G^^(l) for l = 1..L, the gradient at the perturbed model.
        cell_terms: sigma~_s^(l), indexed [s][l], for s = 1..m and l = 1..L.
        beta: beta^(l) for l = 1..L-1 (beta^(L) is 0 and is not sent).
        secrets: the round's secrets.

    Raises:
        ValueError: the counts or shapes do not match the secrets.
    """
    factors = secrets.scale_factors()
    _check_layers(perturbed, factors)
    if len(cell_terms) != secrets.cells or len(beta) != len(factors) - 1:
        raise ValueError(
            f"The recovery needs {secrets.cells} cell terms and {len(factors) - 1} beta terms, "
            f"got {len(cell_terms)} and {len(beta)}."
        )
    v = secrets.shift_norm_sq()
    recovered = []
    for layer, factor in enumerate(factors):
        inner = np.array(perturbed[layer], dtype=np.float64, copy=True)
        for gamma, terms in zip(secrets.cell_scales, cell_terms, strict=True):
            inner -= gamma * terms[layer]
        if layer < len(beta):
            inner += v * beta[layer]
        recovered.append(factor * inner)
    return recovered


def recover_upload(
    perturbed: Sequence[np.ndarray],
    cells: Sequence[np.ndarray],
    cell_row: np.ndarray,
    beta: Sequence[np.ndarray],
    secrets: RoundSecrets,
    *,
    factors: Sequence[np.ndarray] | None = None,
) -> list[np.ndarray]:
    """``recover_gradient`` for the stacked form a client uploads (``PerturbedTerms``).

    Hidden layers: R o (G^^ - sum_s gamma_s cells[s] + v beta). The last layer's cell terms are
    C[:, s] u^T and sum_s gamma_s C[:, s] = r, so there it is R o (G^^ - r u^T).

    Args:
        perturbed: G^^(l) for l = 1..L.
        cells: the cell terms of the hidden layers, each (m, n_l, n_(l-1)).
        cell_row: u, shape (n_(L-1),).
        beta: beta^(l) for l = 1..L-1.
        secrets: the round's secrets.
        factors: ``secrets.scale_factors()``, when the caller already has them.

    Raises:
        ValueError: the counts or shapes do not match the secrets.
    """
    factors = secrets.scale_factors() if factors is None else factors
    _check_layers(perturbed, factors)
    hidden = len(factors) - 1
    expected = [(secrets.cells, *factor.shape) for factor in factors[:-1]]
    if (
        [tuple(c.shape) for c in cells] != expected
        or cell_row.shape != (factors[-1].shape[1],)
        or len(beta) != hidden
    ):
        raise ValueError(
            f"The recovery needs cell terms of shapes {expected}, a row of "
            f"{factors[-1].shape[1]} and {hidden} beta terms."
        )
    v = secrets.shift_norm_sq()
    recovered = []
    for layer in range(hidden):
        terms = cells[layer]
        mixed = (secrets.cell_scales @ terms.reshape(terms.shape[0], -1)).reshape(terms.shape[1:])
        inner = perturbed[layer] - mixed
        inner += v * beta[layer]
        inner *= factors[layer]
        recovered.append(inner)
    last = perturbed[-1] - np.outer(secrets.output_shift(), cell_row)
    last *= factors[-1]
    recovered.append(last)
    return recovered


def recover_value(
    perturbed: float, cell_values: Sequence[float], beta_value: float, secrets: RoundSecrets
) -> float:
    """Returns the true mean loss F^ - sum_s gamma_s f_s + v f_beta (the values of the terms).

    Per sample, ½||y^ - y||² = ½||y + alpha r - y||² expands to the true loss plus
    alpha r.(y^ - y) - ½ alpha² v, and r.(y^ - y) = sum_s gamma_s c_s (digest §2.3).
    """
    return float(
        perturbed
        - float(np.dot(secrets.cell_scales, np.asarray(cell_values, dtype=np.float64)))
        + secrets.shift_norm_sq() * beta_value
    )


def balance_residual(weights: Sequence[np.ndarray], gradient: Sequence[np.ndarray]) -> float:
    """Returns how far a gradient is from the neuron balance of a bias-free ReLU network.

    Scaling a hidden neuron's incoming weights by c > 0 and its outgoing weights by 1/c leaves
    a bias-free ReLU network's function, hence any loss, unchanged (the very symmetry the
    hidden secrets use). Differentiating at c = 1 gives, for every hidden neuron j of layer l,
    <W^(l)[j, :], G^(l)[j, :]> = <W^(l+1)[:, j], G^(l+1)[:, j]> (the conservation law behind
    Du, Hu and Lee, "Algorithmic Regularization in Learning Deep Homogeneous Models: Layers
    are Automatically Balanced", NeurIPS 2018). A wrongly recovered gradient (a wrong secret,
    a garbage upload, lost precision) breaks it almost surely; the true gradient of any loss
    at the same weights keeps it.

    Returns:
        max_j |incoming_j - outgoing_j| / max_l <|W^(l)|, |G^(l)|>: the worst imbalance
        relative to the scale at which the sums are rounded; 0 when the gradient is 0; inf
        if anything is not finite.

    Raises:
        ValueError: the lists differ in length or shapes.
    """
    if len(weights) != len(gradient):
        raise ValueError(f"Got {len(weights)} weight layers and {len(gradient)} gradient layers.")
    for weight, grad in zip(weights, gradient, strict=True):
        if weight.shape != grad.shape:
            raise ValueError(
                f"A weight of shape {weight.shape} has a gradient of shape {grad.shape}."
            )
    products = [weight * grad for weight, grad in zip(weights, gradient, strict=True)]
    scale = max(float(np.sum(np.abs(product))) for product in products)
    worst = 0.0
    for layer in range(len(products) - 1):
        incoming = products[layer].sum(axis=1)
        outgoing = products[layer + 1].sum(axis=0)
        if incoming.shape != outgoing.shape:
            raise ValueError(
                f"Layer {layer + 1} has {incoming.shape[0]} neurons, but layer {layer + 2} "
                f"takes {outgoing.shape[0]} inputs."
            )
        worst = max(worst, float(np.max(np.abs(incoming - outgoing))))
    if not (math.isfinite(worst) and math.isfinite(scale)):
        return math.inf
    return worst / scale if scale > 0 else 0.0


@dataclass(frozen=True)
class PerturbedTerms:
    """A client's m+2 scalar functions of the perturbed weights: their values and gradients.

    Attributes:
        loss: F^, the mean loss at W^^ (``F.mse_loss``, the mean over all output entries).
        loss_grad: dF^/dW^^(l) for l = 1..L.
        cell_values: f_s = k * mean(alpha * c_s) for s = 1..m, with k = 2/n_L the factor that
            turns the per-sample ½||.||² into ``F.mse_loss``.
        cells: df_s/dW^^(l) for the hidden layers l = 1..L-1, each of shape (m, n_l, n_(l-1))
            (sigma~_s scaled by k, stacked over the cells).
        cell_row: u = k mean(alpha h^(L-1)), shape (n_(L-1),): the last layer's cell terms are
            rank one, df_s/dW^^(L) = C[:, s] u^T with C[i, s] = r^(a)_i if s(i) = s, else 0.
        contraction: C, shape (n_L, m).
        beta_value: f_beta = k * mean(alpha² / 2).
        beta_grads: df_beta/dW^^(l) for l = 1..L-1 (beta scaled by k; 0 on the last layer).
    """

    loss: float
    loss_grad: list[np.ndarray]
    cell_values: list[float]
    cells: list[np.ndarray]
    cell_row: np.ndarray
    contraction: np.ndarray
    beta_value: float
    beta_grads: list[np.ndarray]

    @property
    def cell_grads(self) -> list[list[np.ndarray]]:
        """df_s/dW^^(l) indexed [s][l], every layer written out (the hidden ones are views)."""
        return [
            [
                *(layer[cell] for layer in self.cells),
                np.outer(self.contraction[:, cell], self.cell_row),
            ]
            for cell in range(self.contraction.shape[1])
        ]


def perturbed_terms(
    weights: Sequence[torch.Tensor],
    features: torch.Tensor,
    targets: torch.Tensor,
    output_noise: torch.Tensor,
    cell_of_output: torch.Tensor,
    cells: int,
) -> PerturbedTerms:
    """Computes a client's upload maths: the m+2 reverse passes, batched (digest 001, §2.3).

    With c_s = sum_{i in I_s} r^(a)_i (y^_i - y_i) per sample, sigma~_s = d(alpha c_s)/dW^^ and
    beta = d(alpha²/2)/dW^^, so each is one vector-Jacobian product over the whole batch; no
    per-sample or per-output Jacobian is formed, and the m+2 products go back through the
    hidden layers together (``_relu_mlp.noise_term_gradients``). All three kinds are scaled
    alike (k = 2/n_L), so the recovery returns the gradient of ``F.mse_loss`` itself.

    Args:
        weights: W^^(l) for l = 1..L, of shape (n_l, n_{l-1}); not changed.
        features: the inputs, shape (N, ...), flattened to (N, n_0).
        targets: the one-hot targets, shape (N, n_L).
        output_noise: r^(a), shape (n_L,).
        cell_of_output: the cell of each output, shape (n_L,), int64.
        cells: m.

    Returns:
        The values and gradients, as float64 numpy arrays on the CPU.
    """
    outputs = int(weights[-1].shape[0])
    table = np.zeros((outputs, cells))
    table[np.arange(outputs), cell_of_output.cpu().numpy()] = output_noise.cpu().numpy()
    contraction = torch.from_numpy(table).to(weights[-1].device)
    with torch.no_grad():
        passed = _relu_mlp.forward(weights, features)
        terms = _relu_mlp.noise_term_gradients(weights, passed, targets, contraction)
    return PerturbedTerms(
        loss=float(terms.loss),
        loss_grad=[_numpy(g) for g in terms.loss_grads],
        cell_values=[float(value) for value in _numpy(terms.cell_values)],
        cells=[_numpy(g) for g in terms.cell_grads],
        cell_row=_numpy(terms.cell_row),
        contraction=table,
        beta_value=float(terms.beta_value),
        beta_grads=[_numpy(g) for g in terms.beta_grads],
    )


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """A float64 numpy array on the CPU (a view when the tensor already is one)."""
    return tensor.detach().to("cpu", torch.float64).numpy()


def _check_layers(layers: Sequence[np.ndarray], factors: Sequence[np.ndarray]) -> None:
    """Refuses layers whose count or shapes differ from the secrets' scale factors."""
    shapes = [tuple(layer.shape) for layer in layers]
    expected = [tuple(factor.shape) for factor in factors]
    if shapes != expected:
        raise ValueError(f"The layers have shapes {shapes}; the secrets are for {expected}.")
