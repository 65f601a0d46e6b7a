"""Small file-system helpers shared by the stores and the PKI."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path


def write_atomically(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Writes ``data`` to ``path`` through a synced temporary file in the same folder, then
    renames it over ``path``: readers see the old content or the new one, never a mix.

    Raises:
        OSError: the write failed; ``path`` is unchanged and no temporary file is left.
    """
    write_chunks_atomically(path, (data,), mode=mode)


def write_chunks_atomically(
    path: Path, chunks: Iterable[bytes | memoryview], *, mode: int = 0o644
) -> int:
    """Like ``write_atomically``, for data given as chunks (never all in memory); returns the
    number of bytes written.

    Raises:
        OSError: the write failed; ``path`` is unchanged and no temporary file is left.
        Exception: whatever the chunks' iterator raises, with the same guarantee.
    """
    descriptor, temporary = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"
    )
    try:
        os.fchmod(descriptor, mode)
        written = 0
        with os.fdopen(descriptor, "wb") as handle:
            for chunk in chunks:
                written += handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return written
