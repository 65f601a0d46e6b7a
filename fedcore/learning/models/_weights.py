"""Model weights as named numpy arrays: read them out of a module and load them back."""

from __future__ import annotations

import functools
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn


def get_weights(
    module: nn.Module, state: Mapping[str, torch.Tensor] | None = None, *, copy: bool = True
) -> dict[str, np.ndarray]:
    """Returns copies of a module's state (parameters and buffers) as numpy arrays.

    Args:
        module: the module to read.
        state: its ``state_dict()`` if the caller holds one taken since its parameters were
            last replaced (``set_weights`` returns it); None: taken here.
        copy: False: views of a CPU module's tensors (they change as the module does).

    Returns:
        One detached CPU copy (or view) per ``state_dict`` entry, in ``state_dict`` order.
    """
    if state is None:
        state = module.state_dict()
    return {name: tensor.detach().to("cpu", copy=copy).numpy() for name, tensor in state.items()}


def set_weights(
    module: nn.Module,
    weights: dict[str, np.ndarray],
    *,
    borrow: bool = False,
    in_place: bool = False,
) -> dict[str, torch.Tensor]:
    """Copies ``weights`` into a module's state in place; returns the ``state_dict()`` it
    copied into (views of the module's tensors).

    The names, shapes and dtypes must match ``module.state_dict()`` exactly; nothing is
    copied unless all of them do. ``weights`` itself is not changed (unless ``in_place``).

    Args:
        module: the module to load into.
        weights: one array per ``state_dict`` entry, as :func:`get_weights` returns.
        borrow: make the module's tensors views of ``weights`` instead of copying them (a CPU
            module only; its own storage is let go). The caller must not change ``weights``
            while the module is used, nor train the module.
        in_place: make the module's parameters and buffers views of ``weights`` (a CPU
            module only), keeping the same parameter objects, so that an optimizer built over
            them stays valid: training the module then changes ``weights``, and the module's
            own storage is let go. For a caller that owns ``weights`` and is done with them.
            An array torch cannot view (read-only, negatively strided) is copied. Until it is
            loaded in place again (or borrows), the module then never writes those arrays: a
            later copying load gives it fresh storage (they may be an upload still being
            sent, by another user of the same module).

    Raises:
        ValueError: naming the tensor, if a name is missing or unexpected, or a shape or
            dtype differs.
    """
    state = module.state_dict()
    if weights.keys() != state.keys():
        missing = [name for name in state if name not in weights]
        unexpected = [name for name in weights if name not in state]
        raise ValueError(
            f"The weights do not match the model: missing {missing}, unexpected {unexpected}."
        )
    for name, tensor in state.items():
        array = weights[name]
        if not isinstance(array, np.ndarray):
            raise ValueError(f"The weight {name!r} is a {type(array).__name__}, not a numpy array.")
        expected = _numpy_dtype(tensor.dtype)
        if array.shape != tuple(tensor.shape) or array.dtype != expected:
            raise ValueError(
                f"The weight {name!r} has shape {array.shape} and dtype {array.dtype}, but the "
                f"model's has shape {tuple(tensor.shape)} and dtype {expected}."
            )
    if borrow:
        module.load_state_dict({name: _as_tensor(weights[name]) for name in state}, assign=True)
        module.__dict__[_LENT] = False
        return module.state_dict()
    if in_place or module.__dict__.get(_LENT, False):
        # A module that views lent arrays (an upload, maybe still being sent) is never
        # written: weights copied in go to fresh storage of its own.
        lent = in_place
        if not in_place:
            weights = {name: np.array(weights[name], copy=True) for name in state}
        own: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
        own.update(module.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for name in state:
                own[name].data = _as_tensor(weights[name])
        module.__dict__[_LENT] = lent
        return module.state_dict()
    with torch.no_grad():
        for name, tensor in state.items():
            tensor.copy_(_as_tensor(weights[name]))
    return state


_LENT = "_fedcore_views_lent_weights"
"""Set on a module whose tensors are not its own to write: views of arrays lent to
``set_weights(in_place=True)``, or storage let go (``release_storage``)."""


def release_storage(module: nn.Module) -> None:
    """Lets go of a CPU module's parameter and buffer memory, keeping every shape, dtype and
    parameter object: each becomes a broadcast zero (one element). The module must be loaded
    (``set_weights``, which then gives it storage again) before it is used: a client whose
    model is always loaded with a task it trains in never needs its own copy of a large model.
    """
    own: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    own.update(module.named_buffers(remove_duplicate=False))
    with torch.no_grad():
        for tensor in own.values():
            tensor.data = torch.zeros((), dtype=tensor.dtype, device=tensor.device).expand(
                tensor.shape
            )
    module.__dict__[_LENT] = True


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    """Wraps an array without a copy where torch allows it (writable and positively strided)."""
    if any(stride < 0 for stride in array.strides):
        return torch.from_numpy(np.ascontiguousarray(array))
    if array.flags.writeable:
        return torch.from_numpy(array)
    return torch.tensor(array)


@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype that a torch dtype turns into."""
    return torch.empty((), dtype=dtype).numpy().dtype
