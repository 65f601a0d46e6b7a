"""A run's compression of the tensors between server and clients (``spec.transport.compression``).

The roles and ``simulate()`` both go through here, so a compressed run's simulation computes what
its processes compute: the server compresses a round's broadcast once, each client its upload,
and the receiver decompresses before anything else looks at the tensors. The codecs and their
error bounds are ``fedcore.transport._compression``'s. Stochastic rounding draws from generators
seeded by ``spec.seed``, the round, the attempt and the client: reproducible, and public (the
rounding protects nothing; it only keeps the rounding unbiased).

A message says how it was compressed (``Payload.meta["compression"]``); a receiver refuses one
compressed with another codec than the spec's, or compressed where the spec says ``None``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from fedcore.errors import MessageRejected
from fedcore.spec import FederatedRunSpec
from fedcore.transport._compression import compress, decompress

Direction = Literal["uploads", "broadcasts"]

META_KEY = "compression"
"""Where a message's meta says how its tensors were compressed."""
_TAGS = {"uploads": 0x75706C64, "broadcasts": 0x62636173}
"""Domain separation of the rounding generators ('upld', 'bcas')."""


def compress_tensors(
    spec: FederatedRunSpec,
    direction: Direction,
    tensors: Mapping[str, np.ndarray],
    *,
    round: int,
    attempt: int,
    client: int = 0,
) -> tuple[dict[str, np.ndarray], dict[str, Any] | None]:
    """The tensors to send and the description to put under ``META_KEY`` (None: sent exact,
    the spec compresses nothing in this direction)."""
    settings = spec.transport.compression
    codec = getattr(settings, direction)
    if codec == "None":
        return dict(tensors), None
    rng = None
    if settings.rounding == "Stochastic":
        rng = np.random.default_rng([spec.seed, round, attempt, client, _TAGS[direction]])
    return compress(tensors, codec, settings.rounding, rng)


def decompress_tensors(
    spec: FederatedRunSpec,
    direction: Direction,
    tensors: Mapping[str, np.ndarray],
    description: Any,
    *,
    what: str,
) -> dict[str, np.ndarray]:
    """The tensors a message carried, decompressed as its description says.

    Raises:
        MessageRejected: the message is compressed where the spec says ``None``, or with
            another codec than the spec's, or its description is malformed (naming ``what``).
    """
    if description is None:
        return dict(tensors)  # sent exact: always acceptable
    codec = getattr(spec.transport.compression, direction)
    if codec == "None":
        raise MessageRejected(
            f"The {what} is compressed, but spec.transport.compression.{direction} is None."
        )
    if isinstance(description, dict):
        for name, entry in description.items():
            found = entry.get("codec") if isinstance(entry, dict) else None
            if found != codec:
                raise MessageRejected(
                    f"The {what}'s tensor {name!r} is compressed with {found!r}, but "
                    f"spec.transport.compression.{direction} is {codec!r}."
                )
    try:
        return decompress(tensors, description)
    except MessageRejected as exc:
        raise MessageRejected(f"The {what} cannot be decompressed: {exc}") from exc


def round_trip(
    spec: FederatedRunSpec,
    direction: Direction,
    tensors: Mapping[str, np.ndarray],
    *,
    round: int,
    attempt: int,
    client: int = 0,
) -> dict[str, np.ndarray]:
    """What the receiver gets of ``tensors`` (``simulate()``'s stand-in for the wire)."""
    sent, description = compress_tensors(
        spec, direction, tensors, round=round, attempt=attempt, client=client
    )
    return decompress_tensors(spec, direction, sent, description, what=direction[:-1])
