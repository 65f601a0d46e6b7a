"""The model zoo: build the network a manifest names, initialised from a seed."""

from __future__ import annotations

import importlib
import math

import torch
from torch import nn

from fedcore.spec import ModelSpec

_ACTIVATIONS: dict[str, type[nn.Module]] = {"ReLU": nn.ReLU, "Tanh": nn.Tanh, "Sigmoid": nn.Sigmoid}
_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float64": torch.float64}


def build_model(
    model: ModelSpec, input_shape: tuple[int, ...], num_classes: int, *, seed: int
) -> nn.Module:
    """Builds the network of ``model`` with weights drawn from ``seed``.

    The draw happens under ``torch.random.fork_rng``, so the global torch RNG is left as it
    was and the same seed always gives the same weights.

    Args:
        model: the manifest's ``spec.model``.
        input_shape: the shape of one example, e.g. ``(1, 8, 8)``.
        num_classes: the number of outputs (logits).
        seed: the seed of the initial weights.

    Returns:
        The module, in ``model.dtype``, on the CPU, in training mode.

    Raises:
        ValueError: if the input shape does not suit the kind (CNN needs (channels, height,
            width)), or the Import factory cannot be imported, fails, or returns no
            ``torch.nn.Module``.
    """
    if num_classes < 1:
        raise ValueError(f"A model needs at least 1 output class, got {num_classes}.")
    if not input_shape or any(size < 1 for size in input_shape):
        raise ValueError(f"The input shape {input_shape} has no or empty dimensions.")
    with torch.random.fork_rng(devices=[]):
        # The CPU generator only (all a model is built with): torch.manual_seed also queues
        # the seeding of every accelerator, which fork_rng(devices=[]) would not undo, and
        # captures a stack each time (a tenth of a role's start).
        torch.default_generator.manual_seed(seed)
        if model.kind == "MLP":
            module = _mlp(model, input_shape, num_classes)
        elif model.kind == "CNN":
            module = _cnn(model, input_shape, num_classes)
        else:
            module = _imported(model, input_shape, num_classes)
    return module.to(dtype=_DTYPES[model.dtype])


def _mlp(model: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Flatten, then Linear + activation per hidden width, then a Linear to the logits."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for hidden in model.hidden:
        layers += [nn.Linear(width, hidden, bias=model.bias), _ACTIVATIONS[model.activation]()]
        width = hidden
    layers.append(nn.Linear(width, num_classes, bias=model.bias))
    return nn.Sequential(*layers)


def _cnn(model: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Conv 3x3 + activation + 2x2 max-pool per channel entry, then a Linear to the logits."""
    if len(input_shape) != 3:
        raise ValueError(
            f"spec.model.kind CNN needs examples of shape (channels, height, width), got "
            f"{input_shape}."
        )
    channels, height, width = input_shape
    layers: list[nn.Module] = []
    for out_channels in model.channels:
        layers += [
            nn.Conv2d(channels, out_channels, kernel_size=3, padding=1, bias=model.bias),
            _ACTIVATIONS[model.activation](),
        ]
        if height >= 2 and width >= 2:
            layers.append(nn.MaxPool2d(2))
            height, width = height // 2, width // 2
        channels = out_channels
    layers += [nn.Flatten(), nn.Linear(channels * height * width, num_classes, bias=model.bias)]
    return nn.Sequential(*layers)


def _imported(model: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Calls the user's factory ``package.module:function`` with (input_shape, num_classes)."""
    path = model.import_path
    if path is None or ":" not in path:
        raise ValueError(
            f"spec.model.importPath must be 'package.module:function' for kind Import, got "
            f"{path!r}."
        )
    module_name, function_name = path.split(":", 1)
    try:
        factory = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"spec.model.importPath {path!r} cannot be imported: {exc}") from exc
    if not callable(factory):
        raise ValueError(
            f"spec.model.importPath {path!r} names a {type(factory).__name__}, not a function."
        )
    try:
        built = factory(tuple(input_shape), num_classes)
    except Exception as exc:
        raise ValueError(
            f"spec.model.importPath {path!r} failed for input shape {input_shape} and "
            f"{num_classes} classes: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(built, nn.Module):
        raise ValueError(
            f"spec.model.importPath {path!r} returned a {type(built).__name__}, not a "
            f"torch.nn.Module."
        )
    return built


def model_bytes(model: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> int:
    """The bytes of the weights (parameters and buffers) ``build_model`` would make.

    The network is built on torch's meta device: shapes and dtypes without storage, so a model
    of any size is measured in the time its modules take to construct, in no memory. (A user
    factory that reads its weights from a file still reads them.)

    Raises:
        ValueError: as ``build_model``.
    """
    with torch.device("meta"):
        module = build_model(model, input_shape, num_classes, seed=0)
    tensors = [*module.parameters(), *module.buffers()]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)
