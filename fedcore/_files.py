"""Small file-system helpers shared by the stores and the PKI."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Writes ``data`` to ``path`` through a synced temporary file in the same folder, then
    renames it over ``path``: readers see the old content or the new one, never a mix.

    Raises:
        OSError: the write failed; ``path`` is unchanged and no temporary file is left.
    """
    descriptor, temporary = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"
    )
    try:
        os.fchmod(descriptor, mode)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
