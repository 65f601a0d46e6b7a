"""The batched reverse passes of perturb and mpdp (fedcore.protocols._relu_mlp) against autograd."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from fedcore.protocols import _relu_mlp
from fedcore.protocols.mpdp import keys as keys_
from fedcore.protocols.mpdp import maths as mpdp_maths


def autograd_terms(
    weights: list[torch.Tensor],
    x: torch.Tensor,
    t: torch.Tensor,
    contraction: torch.Tensor,
    diagonals: list[torch.Tensor] | None,
) -> list[list[torch.Tensor]]:
    """The m+2 gradients by one autograd pass each: [F^, f_1..f_m, f_beta][layer]."""
    params = [w.clone().requires_grad_(True) for w in weights]
    h = x
    for layer, w in enumerate(params[:-1]):
        h = torch.relu(h @ w.T) * (1.0 if diagonals is None else diagonals[layer])
    alpha = h.sum(dim=1)
    y = h @ params[-1].T
    k = 2.0 / y.shape[1]
    scalars = [
        torch.nn.functional.mse_loss(y, t),
        *(k * (alpha[:, None] * ((y - t) @ contraction)).mean(dim=0)).unbind(),
        k * (alpha * alpha / 2.0).mean(),
    ]
    grads = []
    for scalar in scalars:
        found = torch.autograd.grad(scalar, params, retain_graph=True, allow_unused=True)
        grads.append(
            [torch.zeros_like(w) if g is None else g for g, w in zip(found, weights, strict=True)]
        )
    return grads


@pytest.mark.parametrize("widths", [[5, 4, 3], [6, 7, 5, 4], [7, 4, 6, 5, 2]])
@pytest.mark.parametrize("diagonal", [False, True])
@pytest.mark.parametrize("batch", [None, 10])
def test_noise_term_gradients_equal_one_autograd_pass_per_scalar(widths, diagonal, batch) -> None:
    # Prepare
    rng = np.random.default_rng(len(widths))
    weights = [torch.from_numpy(rng.normal(size=(b, a))) for a, b in itertools.pairwise(widths)]
    x = torch.from_numpy(rng.normal(size=(23, widths[0])))
    t = torch.from_numpy(rng.normal(size=(23, widths[-1])))
    contraction = torch.from_numpy(rng.normal(size=(widths[-1], 3)))
    diagonals = (
        [torch.from_numpy(rng.uniform(0.5, 2, size=n)) for n in widths[1:-1]] if diagonal else None
    )
    expected = autograd_terms(weights, x, t, contraction, diagonals)
    # Execute (``batch`` forces the examples through in slices)
    saved = _relu_mlp.BATCH_ELEMENTS
    if batch is not None:
        _relu_mlp.BATCH_ELEMENTS = batch
    try:
        passed = _relu_mlp.forward(weights, x, diagonals)
        got = _relu_mlp.noise_term_gradients(weights, passed, t, contraction)
    finally:
        _relu_mlp.BATCH_ELEMENTS = saved
    # Assert
    layers = len(weights)
    for layer in range(layers):
        torch.testing.assert_close(got.loss_grads[layer], expected[0][layer], rtol=0, atol=1e-12)
    for cell in range(3):
        for layer in range(layers - 1):
            torch.testing.assert_close(
                got.cell_grads[layer][cell], expected[1 + cell][layer], rtol=0, atol=1e-12
            )
        last = torch.outer(contraction[:, cell], got.cell_row)
        torch.testing.assert_close(last, expected[1 + cell][-1], rtol=0, atol=1e-12)
    for layer in range(layers - 1):
        torch.testing.assert_close(got.beta_grads[layer], expected[-1][layer], rtol=0, atol=1e-12)
    assert torch.all(expected[-1][-1] == 0), "f_beta does not reach the last layer"


def test_unit_noise_box_muller_blocks_are_independent_standard_normals() -> None:
    # Prepare
    bits = np.random.default_rng(3).integers(0, 2**64, size=40 * 1024, dtype=np.uint64)
    # Execute
    draws = 0.5 * mpdp_maths.unit_noise(bits, gaussian=True)
    # Assert: one draw per word; each block's cos and sin halves normal and uncorrelated.
    assert len(draws) == 40 * 1024
    assert stats.kstest(draws / 0.5, "norm").pvalue > 0.01
    blocks = draws.reshape(-1, 1024)
    assert abs(np.corrcoef(blocks[:, :512].ravel(), blocks[:, 512:].ravel())[0, 1]) < 0.03


def test_keystream_is_aes_ctr_of_zeros_with_the_stream_in_the_nonce() -> None:
    # Prepare
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    key = bytes(range(32))
    for count in (1, 7, 4096):
        nonce = (2).to_bytes(8, "big") + bytes(8)
        encryptor = Cipher(algorithms.AES(key), modes.CTR(nonce)).encryptor()
        expected = np.frombuffer(encryptor.update(bytes(8 * count)), dtype="<u8")
        # Execute
        words = keys_.keystream(key, 2, count)
        # Assert
        np.testing.assert_array_equal(words, expected)
        assert words.dtype == np.uint64 and words.flags.writeable
