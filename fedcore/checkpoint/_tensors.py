"""The safetensors format, streamed: written chunk by chunk, read into one buffer without copies.

``safetensors.numpy.save`` builds the whole file in memory and ``load`` copies every tensor out
of it; for a 1 GB model that is 2-3 GB of RAM on top of the model. Here the file is produced as
a header followed by memory views of the arrays themselves (the bytes are the same as the
library's, tested), and read back as arrays that are views of the one verified buffer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedcore.errors import CheckpointError

CHUNK_BYTES = 8 * 1024 * 1024
"""The largest chunk ``TensorFile.chunks`` yields."""

_CODES = {
    "BOOL": np.dtype("bool"),
    "U8": np.dtype("uint8"),
    "I8": np.dtype("int8"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "F16": np.dtype("<f2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "F32": np.dtype("<f4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F64": np.dtype("<f8"),
}
_NAMES = {(dtype.kind, dtype.itemsize): code for code, dtype in _CODES.items()}
_ORDER = ("BOOL", "U8", "I8", "I16", "U16", "F16", "I32", "U32", "F32", "F64", "I64", "U64")
"""The library's dtype order: files list tensors by dtype, last first (so by alignment)."""


def _code_of(name: str, array: np.ndarray) -> str:
    code = _NAMES.get((array.dtype.kind, array.dtype.itemsize))
    if code is None:
        raise CheckpointError(
            f"The tensor {name!r} has dtype {array.dtype}, which a checkpoint cannot hold "
            f"(allowed: {', '.join(str(d) for d in _CODES.values())})."
        )
    return code


@dataclass(frozen=True)
class TensorFile:
    """One safetensors file, ready to stream: its header and its arrays in file order.

    Attributes:
        header: the 8-byte header length, then the JSON header padded with spaces to 8 bytes.
        arrays: (name, little-endian C-contiguous array) in file order.
        size: the file's total size in bytes.
    """

    header: bytes
    arrays: tuple[tuple[str, np.ndarray], ...]
    size: int

    @classmethod
    def of(cls, tensors: Mapping[str, np.ndarray]) -> TensorFile:
        """Lays out ``tensors`` as the safetensors library does (by dtype, then name).

        Raises:
            CheckpointError: a tensor's dtype has no safetensors code.
        """
        ordered = []
        for name, value in tensors.items():
            code = _code_of(name, value)
            array = np.ascontiguousarray(value, dtype=_CODES[code])
            if array.shape != value.shape:  # ascontiguousarray makes 0-d arrays 1-d
                array = array.reshape(value.shape)
            ordered.append((-_ORDER.index(code), name, code, array))
        ordered.sort(key=lambda item: (item[0], item[1]))
        header: dict[str, dict[str, object]] = {}
        offset = 0
        for _, name, code, array in ordered:
            header[name] = {
                "dtype": code,
                "shape": list(array.shape),
                "data_offsets": [offset, offset + array.nbytes],
            }
            offset += array.nbytes
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)
        return cls(
            header=len(text).to_bytes(8, "little") + text,
            arrays=tuple((name, array) for _, name, _, array in ordered),
            size=8 + len(text) + offset,
        )

    def write(self, path: Path) -> None:
        """Writes the file to ``path`` through ``path``.tmp, renamed over it when whole: the
        arrays' own bytes, never a copy of them (safetensors' ``save_file`` copied every
        tensor to bytes first: a model's size more at a server's release of the model)."""
        partial = path.with_name(path.name + ".tmp")
        with open(partial, "wb") as file:
            for chunk in self.chunks():
                file.write(chunk)
        partial.replace(path)

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[memoryview]:
        """Yields the file's bytes: the header, then views of each array (no copies)."""
        yield memoryview(self.header)
        for _, array in self.arrays:
            if array.nbytes == 0:
                continue
            view = array.reshape(-1).view(np.uint8).data
            for start in range(0, len(view), chunk_bytes):
                yield view[start : start + chunk_bytes]


def read_tensors(buffer: bytearray, *, what: str) -> dict[str, np.ndarray]:
    """Parses a safetensors file held in ``buffer``; the arrays are writable views of it.

    Args:
        buffer: the whole file (the caller hands it over: the arrays share its memory).
        what: names the file in error messages.

    Raises:
        CheckpointError: the header is malformed, names an unknown dtype, or its offsets do
            not tile the data exactly.
    """
    view = memoryview(buffer)
    if len(view) < 8:
        raise CheckpointError(f"{what} is too short to be a safetensors file.")
    length = int.from_bytes(view[:8], "little")
    if length > len(view) - 8:
        raise CheckpointError(f"{what} announces a header longer than the file.")
    try:
        header = json.loads(bytes(view[8 : 8 + length]))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{what} has a header that is not JSON.") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{what} has a header that is not a JSON object.")
    base = 8 + length
    data_bytes = len(view) - base
    spans: list[tuple[int, int, str]] = []
    arrays: dict[str, np.ndarray] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, end = _entry(name, entry, what)
        count = math.prod(shape)
        if end - begin != count * dtype.itemsize or not 0 <= begin <= end <= data_bytes:
            raise CheckpointError(f"{what}: the offsets of tensor {name!r} do not fit its shape.")
        spans.append((begin, end, name))
        array = np.frombuffer(buffer, dtype=dtype, count=count, offset=base + begin)
        if (base + begin) % dtype.itemsize:
            array = array.copy()  # unaligned in the file: an aligned copy
        arrays[name] = array.reshape(shape)
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise CheckpointError(f"{what}: tensor {name!r} overlaps another or leaves a gap.")
        position = end
    if position != data_bytes:
        raise CheckpointError(f"{what} has {data_bytes - position} bytes no tensor accounts for.")
    return arrays


def _entry(name: str, entry: object, what: str) -> tuple[np.dtype, tuple[int, ...], int, int]:
    """Checks one header entry; returns (dtype, shape, begin, end)."""
    if not isinstance(entry, dict):
        raise CheckpointError(f"{what}: the header entry of {name!r} is not an object.")
    code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if code not in _CODES:
        raise CheckpointError(f"{what}: tensor {name!r} has an unknown dtype {code!r}.")
    if not isinstance(shape, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise CheckpointError(f"{what}: tensor {name!r} has an invalid shape {shape!r}.")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in offsets)
    ):
        raise CheckpointError(f"{what}: tensor {name!r} has invalid offsets {offsets!r}.")
    return _CODES[str(code)], tuple(shape), offsets[0], offsets[1]
