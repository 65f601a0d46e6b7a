"""What the local runner measures before it spreads the clients over processes.

``fedcore run`` does not import torch itself (its start would wait on it), so the size of a
user's model (``spec.model.kind: Import``, the kind large models come as) is measured in a
child forked from the roles' warm forkserver: the manifest is loaded, the data's shapes read
(``dataset_info``: no example) and the model built on torch's meta device
(``fedcore.learning.models.model_bytes``: no storage). The child answers with one decimal
number over a pipe (nothing is unpickled from it); any failure answers nothing, and the roles
then report the real error themselves.
"""

from __future__ import annotations

import multiprocessing
import threading
from multiprocessing.connection import Connection
from pathlib import Path

ANSWER_BYTES = 32
"""The longest answer read from the child (a decimal byte count)."""


class ModelSizeProbe:
    """Measures the bytes of ``manifest``'s model in a forked child, from a thread started at
    once (starting a fork waits for the forkserver's imports; the caller does not).

    Args:
        manifest: the run's manifest file.
        timeout: how long the child may take, from when it is forked.
    """

    def __init__(self, manifest: Path, *, timeout: float) -> None:
        self._manifest = str(manifest)
        self._timeout = timeout
        self._answer: int | None = None
        self._thread = threading.Thread(target=self._ask, name="fedcore-probe", daemon=True)
        self._thread.start()

    def result(self, timeout: float) -> int | None:
        """The model's bytes, waiting up to ``timeout`` seconds more; None if the child failed
        or did not answer in time."""
        self._thread.join(timeout)
        return None if self._thread.is_alive() else self._answer

    def _ask(self) -> None:
        context = multiprocessing.get_context("forkserver")
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(
            target=_measure, args=(self._manifest, writer), daemon=True, name="fedcore-probe"
        )
        try:
            process.start()
            writer.close()
            if reader.poll(self._timeout):
                text = reader.recv_bytes(ANSWER_BYTES).decode("ascii")
                self._answer = int(text) if text.isdigit() else None
        except (EOFError, OSError, UnicodeDecodeError):
            self._answer = None
        finally:
            reader.close()
            if process.is_alive():
                process.kill()
            process.join(5)


def _measure(manifest: str, writer: Connection) -> None:
    """The child: writes the model's bytes, or nothing if anything fails."""
    answer = b""
    try:
        from fedcore.learning.data import dataset_info
        from fedcore.learning.models import model_bytes
        from fedcore.spec import load_manifest

        spec = load_manifest(Path(manifest)).spec
        input_shape, num_classes = dataset_info(spec)
        answer = str(model_bytes(spec.model, input_shape, num_classes)).encode("ascii")
    except Exception:  # the roles build the same model and report its error
        answer = b""
    finally:
        writer.send_bytes(answer)
        writer.close()


def available_memory_bytes() -> int | None:
    """The memory this process's children may still take: the machine's MemAvailable, or less
    where a cgroup (a container) limits it; None where neither is known (not Linux)."""
    found: list[int] = []
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError):
        pass
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit.isdigit():
            used = int((cgroup / "memory.current").read_text().strip())
            found.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return min(found) if found else None
