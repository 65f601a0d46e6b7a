"""A user model for fedcore's large-model example: a transformer encoder from torch's own modules.

fedcore builds it from ``spec.model.importPath`` (``big_transformer:digits_transformer``), calling
the factory with the data's input shape and class count; this folder must then be importable
(``PYTHONPATH=$PWD/examples/models``, or the module baked into the image a pod runs).

An image of shape (C, H, W) is read as H tokens of C * W features (a digit's 8 rows of 8 pixels);
a flat vector of F features as F tokens of one feature. Each token is embedded, given a learned
position, passed through pre-norm encoder layers without dropout (so a run is deterministic and
equals its simulation), averaged over the tokens and classified.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class TokenTransformer(nn.Module):
    """Embedding, learned positions, ``layers`` pre-norm encoder layers, mean pool, classifier."""

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        *,
        width: int,
        layers: int,
        heads: int,
    ) -> None:
        super().__init__()
        if len(input_shape) >= 2:
            self.tokens, self.features = input_shape[-2], math.prod(input_shape) // input_shape[-2]
        else:
            self.tokens, self.features = math.prod(input_shape), 1
        self.embed = nn.Linear(self.features, width)
        self.position = nn.Parameter(torch.zeros(1, self.tokens, width))
        layer = nn.TransformerEncoderLayer(
            width, heads, dim_feedforward=4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)
        nn.init.normal_(self.position, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() >= 3:  # (batch, C, H, W) or (batch, H, W): H tokens of C * W features
            x = x.movedim(-2, 1).reshape(x.shape[0], self.tokens, self.features)
        else:
            x = x.reshape(x.shape[0], self.tokens, self.features)
        hidden = self.encoder(self.embed(x) + self.position)
        return self.head(self.norm(hidden).mean(dim=1))


def digits_transformer(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """About 101 million parameters (404 MB in float32): width 1024, 8 layers, 16 heads."""
    return TokenTransformer(input_shape, num_classes, width=1024, layers=8, heads=16)


def transformer_1b(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """About 1.0 billion parameters (4.0 GB in float32): width 2048, 20 layers, 16 heads."""
    return TokenTransformer(input_shape, num_classes, width=2048, layers=20, heads=16)
