"""Lossy compression of float tensors for messages between roles (pure numpy).

Only float32 and float64 tensors are compressed; every other tensor travels as it is. A
compressed tensor carries a small JSON-able description (codec, original dtype, Int8's scale)
that the receiver needs to decompress it.

Codecs, what they cost and what they guarantee (``error_bound`` computes the bounds; x is an
original value, s a tensor's Int8 scale):

* ``Float16``: IEEE half precision, half the bytes of float32. Round to nearest: error at most
  2**-11 * |x| (2**-25 below float16's smallest normal, 2**-14); stochastic: less than one
  float16 step, 2**-10 * |x| (2**-24 below 2**-14). Only tensors whose values all lie within
  float16's range (|x| <= 65504) are compressed.
* ``BFloat16``: float32's top 16 bits (float32's range, 8 significant bits), half the bytes of
  float32. Error at most 2**-8 * |x| (nearest) or 2**-7 * |x| (stochastic), plus 2**-133
  (bfloat16's step below float32's smallest normal). A value whose rounding would reach infinity
  (|x| within one bfloat16 step of float32's maximum) is truncated instead, so a finite value
  never becomes infinite; stochastic rounding is biased toward zero for those values only.
* ``Int8``: one byte per value, a quarter of float32, plus one float per tensor: the scale
  s = max|x| / 127, and the value q * s with q an integer in [-127, 127]. Error at most s / 2
  (nearest) or s (stochastic), plus the float arithmetic's rounding (a relative 2**-40 of s,
  and, for float32 tensors, float32's own rounding of the result: 2**-24 * (|x| + 2 s)).

float64 tensors go through float32 on their way to Float16 and BFloat16: their bounds add
2**-24 * |x|, and a float64 tensor with a value beyond float32's range is not compressed by
BFloat16. Int8 quantizes float64 tensors directly.

Rounding ``Nearest`` is deterministic (float16's and bfloat16's round-half-to-even, Int8's
``rint``). Rounding ``Stochastic`` rounds to one of the two neighbouring representable values
with the probabilities that make it unbiased: E[decompress(compress(x))] = x (for float64
tensors through Float16 or BFloat16: the float32 value of x). Protocols whose maths averages many
uploads need that: nearest rounding's errors do not average out, stochastic rounding's do.

A tensor holding NaN or an infinite value is never compressed: compression must not turn a bad
value into a plausible one. ``decompress`` treats the description as hostile input (it comes
from another party) and raises ``MessageRejected`` for anything ``compress`` cannot have made.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from fedcore.errors import MessageRejected

CODECS = ("Float16", "BFloat16", "Int8")
ROUNDINGS = ("Nearest", "Stochastic")

_WIRE_DTYPES: dict[str, np.dtype[Any]] = {
    "Float16": np.dtype(np.float16),
    "BFloat16": np.dtype(np.uint16),
    "Int8": np.dtype(np.int8),
}
_ORIGINAL_DTYPES: dict[str, np.dtype[Any]] = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}
_FLOAT16_MAX = 65504.0
_INT8_LEVELS = 127
_ENTRY_KEYS = frozenset({"codec", "dtype", "scale"})
_NAME_CHARS = 80


def compress(
    tensors: Mapping[str, np.ndarray],
    codec: str,
    rounding: str,
    rng: np.random.Generator | None,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Compress the float32/float64 tensors of ``tensors`` with ``codec`` and ``rounding``.

    Returns (wire tensors, description): the wire tensors have the same names, order and shapes;
    compressed ones are new arrays (float16, uint16 holding bfloat16 bits, or int8). The
    description maps each compressed tensor's name to a JSON-able dict ``{"codec": codec,
    "dtype": "float32" | "float64"}``, plus ``"scale": float`` for Int8. Every other tensor is
    the same object in the wire tensors and absent from the description: non-float tensors,
    float16, a float tensor holding NaN or an infinite value, for Float16 one with a value beyond
    65504, for BFloat16 a float64 one with a value beyond float32's range.

    ``rng`` draws the stochastic roundings (required for "Stochastic", ignored for "Nearest").

    Raises:
        ValueError: an unknown codec or rounding, or "Stochastic" without an rng.
    """
    _check_choice("codec", codec, CODECS)
    _check_choice("rounding", rounding, ROUNDINGS)
    stochastic = rounding == "Stochastic"
    if stochastic and rng is None:
        raise ValueError("rng is required when rounding is 'Stochastic' (a numpy Generator)")
    draws = rng if stochastic else None
    wire: dict[str, np.ndarray] = {}
    description: dict[str, Any] = {}
    for name, array in tensors.items():
        encoded = _encode(array, codec, draws)
        if encoded is None:
            wire[name] = array
        else:
            wire[name], description[name] = encoded
    return wire, description


def decompress(
    wire: Mapping[str, np.ndarray], description: Any, *, max_entries: int | None = None
) -> dict[str, np.ndarray]:
    """The inverse of ``compress``: the tensors in their original dtypes.

    Same names, order and shapes as ``wire``; decompressed tensors are new arrays, and tensors
    absent from the description are the same objects as in ``wire``. Decompressed values are
    always finite. The description is checked in full before anything is decoded.

    ``max_entries`` caps the description's entries (None: no cap beyond the wire's tensors).

    Raises:
        MessageRejected: the description is not a dict or has more than ``max_entries`` entries;
            or an entry (the message names its tensor) names no wire tensor, is not a dict, has
            keys other than codec, dtype and (Int8 only) scale, names an unknown codec or a dtype
            other than float32/float64, describes a wire array of another dtype than its codec
            makes (Float16: float16, BFloat16: uint16, Int8: int8); or an Int8 scale is missing,
            not a real number, negative, NaN, infinite, or so large that 127 * scale overflows
            the dtype; or the wire array holds a value ``compress`` never makes (a non-finite
            Float16 or BFloat16 value, an Int8 -128).
    """
    if not isinstance(description, dict):
        raise MessageRejected(
            f"The compression description must be a dict, not {type(description).__name__}"
        )
    if max_entries is not None and len(description) > max_entries:
        raise MessageRejected(
            f"The compression description has {len(description)} entries; at most "
            f"{max_entries} are allowed"
        )
    plans = {name: _plan(name, entry, wire) for name, entry in description.items()}
    tensors: dict[str, np.ndarray] = {}
    for name, array in wire.items():
        plan = plans.get(name)
        tensors[name] = array if plan is None else _decode(array, *plan)
    return tensors


def error_bound(
    codec: str, rounding: str, values: np.ndarray, scale: float | None = None
) -> np.ndarray:
    """The per-element bound on |decompress(compress(x)) - x| for the original values ``values``.

    ``values`` is the float32 or float64 tensor as given to ``compress`` (its dtype picks the
    bound); ``scale`` is the tensor's Int8 scale from the description (required for Int8).
    Returns a float64 array of the shape of ``values``. The bounds are the ones the module's
    docstring lists; they hold for every tensor ``compress`` compresses.

    Raises:
        ValueError: an unknown codec or rounding, values not float32/float64, or Int8 without
            a finite, non-negative scale.
    """
    _check_choice("codec", codec, CODECS)
    _check_choice("rounding", rounding, ROUNDINGS)
    values = np.asarray(values)
    if values.dtype.kind != "f" or values.dtype.itemsize not in (4, 8):
        raise ValueError(f"values must be float32 or float64, not {values.dtype}")
    wide = values.dtype.itemsize == 8
    stochastic = rounding == "Stochastic"
    magnitude = np.abs(values.astype(np.float64))
    if codec == "Int8":
        if scale is None or not math.isfinite(scale) or scale < 0:
            raise ValueError(f"Int8's bound needs the tensor's finite, non-negative scale: {scale}")
        steps = (1.0 if stochastic else 0.5) + 2.0**-40
        if wide:
            return np.full(values.shape, scale * steps)
        return scale * steps + 2.0**-24 * (magnitude + 2.0 * scale) + 2.0**-149
    if codec == "Float16":
        relative, floor = (2.0**-10, 2.0**-24) if stochastic else (2.0**-11, 2.0**-25)
        bound = np.where(magnitude >= 2.0**-14, relative * magnitude, floor)
    else:
        bound = (2.0**-7 if stochastic else 2.0**-8) * magnitude + 2.0**-133
    if wide:
        bound = bound + 2.0**-24 * magnitude
    return bound


def _check_choice(what: str, value: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"Unknown {what} {value!r}; allowed: {', '.join(allowed)}")


def _encode(
    array: np.ndarray, codec: str, rng: np.random.Generator | None
) -> tuple[np.ndarray, dict[str, Any]] | None:
    """The wire array and description entry for one tensor, or None when it travels as it is."""
    if not isinstance(array, np.ndarray) or array.dtype.kind != "f":
        return None
    if array.dtype.itemsize not in (4, 8):
        return None
    flat = np.ascontiguousarray(array).reshape(-1)
    if not np.isfinite(flat).all():
        return None
    entry: dict[str, Any] = {"codec": codec, "dtype": f"float{array.dtype.itemsize * 8}"}
    if codec == "Int8":
        quantized, entry["scale"] = _int8(flat, rng)
        return quantized.reshape(array.shape), entry
    if codec == "Float16" and flat.size and max(-np.min(flat), np.max(flat)) > _FLOAT16_MAX:
        return None
    with np.errstate(over="ignore"):
        single = np.asarray(flat, dtype=np.float32)
    if flat.dtype.itemsize == 8 and not np.isfinite(single).all():
        return None  # a float64 value beyond float32's range
    rounded = _float16(single, rng) if codec == "Float16" else _bfloat16(single, rng)
    return rounded.reshape(array.shape), entry


def _float16(values: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
    """float32 values (all within float16's range) as float16."""
    nearest = values.astype(np.float16)
    if rng is None:
        return nearest
    x = values.astype(np.float64)
    near = nearest.astype(np.float64)
    toward = np.where(near < x, np.inf, -np.inf).astype(np.float16)
    with np.errstate(over="ignore"):
        other = np.nextafter(nearest, toward).astype(np.float64)
    # x lies between `near` and `other`; taking `other` with probability |x - near| / |other -
    # near| keeps the mean at x. An exact value has probability 0 (its `other` may be infinite).
    take = rng.random(x.size) < np.abs(x - near) / np.abs(other - near)
    return np.where(take, other, near).astype(np.float16)


def _bfloat16(values: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
    """Finite, contiguous float32 values as bfloat16 bits (uint16)."""
    bits = values.view(np.uint32)
    if rng is None:
        bias = ((bits >> 16) & 1) + np.uint32(0x7FFF)  # round half to even
    else:
        bias = rng.integers(0, 1 << 16, size=bits.size, dtype=np.uint32)
    # Finite bits are at most 0xFF7FFFFF: adding at most 0xFFFF cannot wrap around uint32.
    rounded = ((bits + bias) >> 16).astype(np.uint16)
    overflow = (rounded & 0x7FFF) == 0x7F80
    return np.where(overflow, (bits >> 16).astype(np.uint16), rounded)


def _int8(values: np.ndarray, rng: np.random.Generator | None) -> tuple[np.ndarray, float]:
    """Finite values as int8 levels in [-127, 127] and the scale that maps them back."""
    scaled = values.astype(np.float64)
    peak = float(np.max(np.abs(scaled))) if scaled.size else 0.0
    if peak == 0.0:
        return np.zeros(scaled.size, dtype=np.int8), 0.0
    scale = _int8_scale(peak)
    np.divide(scaled, scale, out=scaled)
    if rng is None:
        np.rint(scaled, out=scaled)
    else:
        scaled += rng.random(scaled.size)
        np.floor(scaled, out=scaled)
    np.clip(scaled, -_INT8_LEVELS, _INT8_LEVELS, out=scaled)
    return scaled.astype(np.int8), scale


def _int8_scale(peak: float) -> float:
    """peak / 127, nudged so that peak / scale <= 127 (a subnormal quotient can lose most of its
    precision) and 127 * scale stays finite (peak near float64's maximum)."""
    scale = peak / _INT8_LEVELS
    if scale * _INT8_LEVELS < peak:
        scale = math.nextafter(scale, math.inf)
    while not math.isfinite(scale * _INT8_LEVELS):
        scale = math.nextafter(scale, 0.0)
    return scale


def _label(name: Any) -> str:
    text = repr(name)
    return text if len(text) <= _NAME_CHARS else text[: _NAME_CHARS - 3] + "..."


def _plan(
    name: Any, entry: Any, wire: Mapping[str, np.ndarray]
) -> tuple[str, np.dtype[Any], float]:
    """Check one description entry against its wire array: (codec, original dtype, scale)."""

    def reject(problem: str) -> MessageRejected:
        return MessageRejected(f"The compression description of tensor {_label(name)} {problem}")

    if name not in wire:
        raise reject("names no tensor of the message")
    if not isinstance(entry, dict):
        raise reject(f"must be a dict, not {type(entry).__name__}")
    unknown = [key for key in entry if key not in _ENTRY_KEYS]
    if unknown:
        keys = ", ".join(sorted(_label(key) for key in unknown))
        raise reject(f"has unknown keys {keys}; allowed: codec, dtype, scale (Int8 only)")
    for key in ("codec", "dtype"):
        if key not in entry:
            raise reject(f"has no {key}")
    codec = entry["codec"]
    if not isinstance(codec, str) or codec not in CODECS:
        raise reject(f"has unknown codec {_label(codec)}; allowed: {', '.join(CODECS)}")
    dtype_name = entry["dtype"]
    if not isinstance(dtype_name, str) or dtype_name not in _ORIGINAL_DTYPES:
        raise reject(f"has dtype {_label(dtype_name)}; allowed: float32, float64")
    dtype = _ORIGINAL_DTYPES[dtype_name]
    array = wire[name]
    if getattr(array, "dtype", None) != _WIRE_DTYPES[codec]:
        found = getattr(array, "dtype", type(array).__name__)
        raise reject(f"says {codec}, whose wire dtype is {_WIRE_DTYPES[codec]}, not {found}")
    if codec != "Int8":
        if "scale" in entry:
            raise reject(f"carries a scale, which only Int8 has, not {codec}")
        if codec == "Float16" and not np.isfinite(array).all():
            raise reject("holds a non-finite Float16 value, which compression never makes")
        if codec == "BFloat16" and ((array & 0x7F80) == 0x7F80).any():
            raise reject("holds a non-finite BFloat16 value, which compression never makes")
        return codec, dtype, 0.0
    scale = _scale(entry, dtype, reject)
    if (array == -_INT8_LEVELS - 1).any():
        raise reject("holds the Int8 level -128, which compression never makes")
    return codec, dtype, scale


def _scale(
    entry: dict[Any, Any], dtype: np.dtype[Any], reject: Callable[[str], MessageRejected]
) -> float:
    """An Int8 entry's scale, checked: a finite, non-negative real whose 127 levels fit dtype."""
    if "scale" not in entry:
        raise reject("has no scale, which Int8 needs")
    raw = entry["scale"]
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise reject(f"has a scale that is not a number: {_label(raw)}")
    try:
        scale = float(raw)
    except OverflowError:
        scale = math.inf
    if not math.isfinite(scale) or scale < 0:
        raise reject(f"has scale {_label(raw)}; it must be finite and non-negative")
    with np.errstate(over="ignore"):
        top = np.asarray(_INT8_LEVELS * scale, dtype=np.float64).astype(dtype)
    if not np.isfinite(top):
        raise reject(f"has scale {scale!r}, whose 127 levels overflow {dtype}")
    return scale


def _decode(array: np.ndarray, codec: str, dtype: np.dtype[Any], scale: float) -> np.ndarray:
    flat = np.ascontiguousarray(array).reshape(-1)
    if codec == "Float16":
        values = flat.astype(dtype)
    elif codec == "BFloat16":
        values = (flat.astype(np.uint32) << 16).view(np.float32).astype(dtype, copy=False)
    else:
        values = (flat.astype(np.float64) * scale).astype(dtype, copy=False)
    return values.reshape(array.shape)
