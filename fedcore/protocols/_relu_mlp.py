"""The reverse passes of perturb and mpdp, batched: many scalars of one bias-free ReLU MLP at once.

Both protocols need, on a client's whole shard, the gradients of the mean loss and of m+1
"noise" scalars built from the same forward pass (digest 001 §2.3, digest 000 §2.4): the loss
F^ = mse(y^, t), one scalar per cell s, f_s = k mean_n(alpha_n c_sn) with c = (y^ - t) C, and
f_beta = k mean_n(alpha_n^2 / 2), where alpha_n is the sum of the activations feeding the last
layer, C the n_L x m contraction of the outputs into cells and k = 2 / n_L. One autograd pass
per scalar costs m+2 graph walks; here every scalar's gradient with respect to the last hidden
layer is written down in closed form and all of them go back through the hidden layers
together, two matrix products per layer. The result equals autograd's to rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

BATCH_ELEMENTS = 1 << 24
"""The most entries (128 MiB of float64) the batched deltas of one layer take; larger shards
go through in slices of examples, whose gradients add up."""


def as_tensor(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A float64 array as a tensor on ``device``, sharing its memory where it can."""
    if not array.flags.writeable:  # torch would warn, and the tensor could write into it
        array = array.copy()
    return torch.as_tensor(array, dtype=torch.float64, device=device)


@dataclass(frozen=True)
class Forward:
    """One forward pass of a bias-free ReLU MLP, with what its reverse passes need.

    Attributes:
        inputs: the input of every layer, h_0 .. h_(L-1), each of shape (N, n_(l-1)).
        gates: for every hidden layer, d h_l / d z_l per entry, shape (N, n_l): the ReLU's
            0/1 gate times the layer's diagonal scale (if any).
        outputs: y^, shape (N, n_L).
    """

    inputs: list[torch.Tensor]
    gates: list[torch.Tensor]
    outputs: torch.Tensor

    @property
    def alpha(self) -> torch.Tensor:
        """alpha_n, the sum of the activations that feed the last layer, shape (N,)."""
        return self.inputs[-1].sum(dim=1)

    def rows(self, start: int, stop: int) -> Forward:
        """The same pass restricted to examples start..stop-1 (views)."""
        return Forward(
            [h[start:stop] for h in self.inputs],
            [g[start:stop] for g in self.gates],
            self.outputs[start:stop],
        )


def forward(
    weights: Sequence[torch.Tensor],
    features: torch.Tensor,
    diagonals: Sequence[torch.Tensor] | None = None,
) -> Forward:
    """Runs ``features`` (N, ...) through the MLP: h_l = relu(h_(l-1) W_l^T) * d_l.

    Args:
        weights: W_1 .. W_L, each (n_l, n_(l-1)).
        features: the inputs, flattened to (N, n_0).
        diagonals: a positive scale per hidden neuron (mpdp's transitional layers), or None.
    """
    hidden = features.reshape(features.shape[0], -1)
    inputs: list[torch.Tensor] = []
    gates: list[torch.Tensor] = []
    for layer, weight in enumerate(weights[:-1]):
        inputs.append(hidden)
        linear = hidden @ weight.T
        gate = (linear > 0).to(linear.dtype)
        hidden = torch.relu(linear)
        if diagonals is not None:
            gate = gate * diagonals[layer]
            hidden = hidden * diagonals[layer]
        gates.append(gate)
    inputs.append(hidden)
    return Forward(inputs, gates, hidden @ weights[-1].T)


@dataclass(frozen=True)
class NoiseTermGradients:
    """The values and gradients of F^, the m cell scalars f_s and f_beta (see the module).

    Attributes:
        loss: F^, a 0-d tensor.
        cell_values: f_s, shape (m,).
        beta_value: f_beta, a 0-d tensor.
        loss_grads: dF^/dW_l for l = 1..L.
        cell_grads: df_s/dW_l for the hidden layers l = 1..L-1, each (m, n_l, n_(l-1)).
        cell_row: u = k mean_n(alpha_n h_(L-1),n), shape (n_(L-1),): the last layer's cell
            gradients are rank one, df_s/dW_L = C[:, s] u^T.
        beta_grads: df_beta/dW_l for l = 1..L-1 (0 for the last layer, not computed).
    """

    loss: torch.Tensor
    cell_values: torch.Tensor
    beta_value: torch.Tensor
    loss_grads: list[torch.Tensor]
    cell_grads: list[torch.Tensor]
    cell_row: torch.Tensor
    beta_grads: list[torch.Tensor]


def noise_term_gradients(
    weights: Sequence[torch.Tensor],
    passed: Forward,
    targets: torch.Tensor,
    contraction: torch.Tensor | None,
) -> NoiseTermGradients:
    """Returns the m+2 scalars and their gradients with a few matrix products per layer.

    With e = y^ - t (N, n_L), a = alpha, g = k / N and G the ReLU gate (times the diagonal) of
    the last hidden layer, the reverse passes reach that layer's pre-activations as
    g (e W_L) o G for F^, g (a C_s^T W_L + c_s 1) o G for f_s, and g a 1 o G for f_beta;
    the last layer's gradients are g e^T h, g C_s (a^T h) and 0. So with X the layer's input,
    df_s/dW = (C_s^T W_L)^T o B + ((g c_s) o G)^T X, where B = ((g a) o G)^T X is f_beta's own
    gradient: one matrix product for all m+2 scalars of that layer. Layers further down take
    all of them back together, two products per layer.

    Args:
        weights: W_1 .. W_L as passed to :func:`forward`.
        passed: the forward pass.
        targets: t, shape (N, n_L), in the outputs' dtype.
        contraction: C, shape (n_L, m); None is the identity (m = n_L, one cell per output).
    """
    outputs = passed.outputs
    count, width = outputs.shape
    last = passed.inputs[-1]
    alpha = passed.alpha
    residual = outputs - targets
    k = 2.0 / width
    scale = k / count
    cells = residual if contraction is None else residual @ contraction
    mixed = weights[-1] if contraction is None else contraction.T @ weights[-1]
    scaled_alpha = scale * alpha
    loss_out = scale * residual
    scaled_cells = scale * cells
    widest = max(gate.shape[1] for gate in passed.gates)
    step = max(1, BATCH_ELEMENTS // ((mixed.shape[0] + 2) * widest))
    hidden: list[torch.Tensor] = []
    for start in range(0, count, step):
        stop = min(count, start + step)
        part = _hidden_gradients(
            weights,
            passed.rows(start, stop),
            loss_out[start:stop],
            scaled_cells[start:stop],
            scaled_alpha[start:stop],
            mixed,
        )
        hidden = part if not hidden else [a.add_(b) for a, b in zip(hidden, part, strict=True)]
    return NoiseTermGradients(
        loss=torch.nn.functional.mse_loss(outputs, targets),
        cell_values=scale * _sum_rows(alpha[:, None] * cells),
        beta_value=(scale / 2.0) * (alpha * alpha).sum(),
        loss_grads=[*(layer[0] for layer in hidden), loss_out.T @ last],
        cell_grads=[layer[1:-1] for layer in hidden],
        cell_row=_sum_rows(scaled_alpha[:, None] * last),
        beta_grads=[layer[-1] for layer in hidden],
    )


def _sum_rows(products: torch.Tensor) -> torch.Tensor:
    """Sums (N, K) products over the examples, element-wise.

    A vector-matrix product (``alpha @ cells``) would be a BLAS gemv, which MKL splits over the
    examples across threads, so its bits would depend on the thread count. The matrix products
    elsewhere can too, which is why ``simulate()`` runs at the roles' count
    (fedcore/local/threads.py).
    """
    return products.sum(dim=0)


def _hidden_gradients(
    weights: Sequence[torch.Tensor],
    passed: Forward,
    loss_out: torch.Tensor,
    scaled_cells: torch.Tensor,
    scaled_alpha: torch.Tensor,
    mixed: torch.Tensor,
) -> list[torch.Tensor]:
    """The hidden layers' gradients of all m+2 scalars, summed over ``passed``'s examples.

    Returns per hidden layer a (m+2, n_l, n_(l-1)) tensor: F^'s, the m cells', f_beta's.
    """
    gate = passed.gates[-1]
    count = gate.shape[0]
    terms = mixed.shape[0] + 2
    # The m+2 scalars' gradients with respect to the last hidden layer's pre-activations,
    # the cells' without their a C_s^T W_L part (added after the product, through B).
    deltas = torch.empty((count, terms, gate.shape[1]), dtype=gate.dtype, device=gate.device)
    torch.mul(loss_out @ weights[-1], gate, out=deltas[:, 0, :])
    torch.mul(scaled_cells[:, :, None], gate[:, None, :], out=deltas[:, 1:-1, :])
    torch.mul(scaled_alpha[:, None], gate, out=deltas[:, -1, :])
    grads = _weight_gradients(deltas, passed.inputs[-2])
    grads[1:-1].addcmul_(mixed[:, :, None], grads[-1][None])
    if len(weights) == 2:
        return [grads]
    # Further down every scalar needs its whole delta: add the a C_s^T W_L part back.
    deltas[:, 1:-1, :].addcmul_(mixed[None], deltas[:, -1:, :])
    current = (deltas.reshape(-1, gate.shape[1]) @ weights[-2]).reshape(count, terms, -1)
    return [*_backward(weights[:-2], passed, current), grads]


def _backward(
    weights: Sequence[torch.Tensor], passed: Forward, upstream: torch.Tensor
) -> list[torch.Tensor]:
    """Takes K gradients (N, K, n_l) with respect to h_l, the output of ``weights``' last
    layer l, back through layers l..1 (the gates of ``passed``).

    Returns dW for layers 1..l, each (K, n_j, n_(j-1)).
    """
    count, terms, _ = upstream.shape
    grads: list[torch.Tensor] = []
    current = upstream
    for layer in range(len(weights) - 1, -1, -1):
        delta = current * passed.gates[layer][:, None, :]
        rows = delta.shape[2]
        grads.append(_weight_gradients(delta, passed.inputs[layer]))
        if layer > 0:
            current = (delta.reshape(count * terms, rows) @ weights[layer]).reshape(
                count, terms, -1
            )
    return grads[::-1]


def _weight_gradients(deltas: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """sum_n deltas[n, k, j] inputs[n, i] for every k, j, i: K weight gradients, (K, n_j, n_i).

    Computed as inputs^T @ deltas, then transposed: BLAS runs that orientation (a short, wide
    result) about 1.5x faster than deltas^T @ inputs on the shapes of a shard (measured on
    144 examples x 12 terms x 64 x 64 in float64: 0.27 ms against 0.39 ms, copy included).
    """
    count, terms, rows = deltas.shape
    product = inputs.T @ deltas.reshape(count, terms * rows)
    return product.T.contiguous().reshape(terms, rows, -1)
