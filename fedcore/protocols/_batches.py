"""Gradients on chosen rows of a client's shard: plain, and per-example clipped (for DP).

``LocalLearner.gradient`` takes the whole shard; the one-step protocols here (lppa, adaptive)
take a minibatch, or per-example gradients clipped before the mean. Both return one array per
``state_dict`` entry (zeros for buffers), like ``LocalLearner.gradient``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from fedcore.learning.canary import CanaryLearner
from fedcore.learning.models import set_weights
from fedcore.learning.training import LocalLearner
from fedcore.protocols._base import Weights

BATCH_STREAM = 0xB47C
"""Keeps the minibatch draws apart from other uses of the seed."""


def batch_rows(
    count: int, batch_size: int, *, seed: int, step: int, client: int, stream: int = BATCH_STREAM
) -> np.ndarray | None:
    """The rows of one step's minibatch, drawn without replacement; None for the whole shard."""
    if batch_size >= count:
        return None
    rng = np.random.default_rng([seed, step, client, stream])
    return np.sort(rng.choice(count, size=batch_size, replace=False))


def _loss(
    logits: torch.Tensor, labels: torch.Tensor, targets: torch.Tensor, kind: str
) -> torch.Tensor:
    if kind == "MSE":
        return F.mse_loss(logits, targets)
    return F.cross_entropy(logits, labels)


def _select(learner: LocalLearner, rows: np.ndarray | None) -> tuple[torch.Tensor, ...]:
    if rows is None:
        return learner.batch(None)
    return learner.batch(torch.as_tensor(rows, device=learner.labels.device))


def batch_gradient(
    learner: LocalLearner, weights: Weights, rows: np.ndarray | None, *, loss: str
) -> tuple[Weights, float]:
    """The gradient of the mean loss over ``rows`` (None: the whole shard) at ``weights``.

    Returns:
        One array per weight name (zeros for buffers) and the mean loss there (a canary's
        fixed gradient and 0.0, for the canary audit's probes).
    """
    if isinstance(learner, CanaryLearner):
        return learner.gradient_at(weights), 0.0
    model = learner.model
    set_weights(model, weights)
    model.train()
    model.zero_grad(set_to_none=True)
    x, labels, targets = _select(learner, rows)
    value = _loss(model(x), labels, targets, loss)
    value.backward()
    parameters = dict(model.named_parameters(remove_duplicate=False))
    result: Weights = {}
    for name, tensor in model.state_dict().items():
        g = parameters[name].grad if name in parameters else None
        result[name] = (torch.zeros_like(tensor) if g is None else g).detach().cpu().numpy().copy()
    model.zero_grad(set_to_none=True)
    return result, float(value.item())


def clipped_gradient(
    learner: LocalLearner,
    weights: Weights,
    rows: np.ndarray | None,
    *,
    loss: str,
    clipping_norm: float,
) -> tuple[Weights, float, float]:
    """The mean over ``rows`` of per-example gradients, each scaled to L2 norm <= the bound.

    Returns:
        One array per weight name (zeros for buffers), the mean loss, and the share of
        examples that were clipped (a canary's fixed gradient, 0.0 and 0.0).
    """
    if isinstance(learner, CanaryLearner):
        return learner.gradient_at(weights), 0.0, 0.0
    model = learner.model
    set_weights(model, weights)
    model.train()
    x, labels, targets = _select(learner, rows)
    params = {name: p.detach() for name, p in model.named_parameters()}
    buffers = {name: b.detach() for name, b in model.named_buffers()}

    def one(
        p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor, ti: torch.Tensor
    ) -> torch.Tensor:
        out = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return _loss(out, yi.unsqueeze(0), ti.unsqueeze(0), loss)

    per_example = vmap(grad(one), in_dims=(None, 0, 0, 0))(params, x, labels, targets)
    squares = sum(g.reshape(g.shape[0], -1).pow(2).sum(dim=1) for g in per_example.values())
    norms = torch.sqrt(squares)  # type: ignore[arg-type]
    scale = torch.clamp(clipping_norm / torch.clamp(norms, min=1e-30), max=1.0)
    with torch.no_grad():
        value = float(_loss(model(x), labels, targets, loss).item())
    result: Weights = {}
    for name, tensor in model.state_dict().items():
        if name in per_example:
            g = per_example[name]
            shaped = scale.reshape(-1, *([1] * (g.dim() - 1)))
            result[name] = (g * shaped).mean(dim=0).detach().cpu().numpy().copy()
        else:
            result[name] = torch.zeros_like(tensor).cpu().numpy()
    clipped = float((norms > clipping_norm).to(torch.float64).mean().item())
    return result, value, clipped
