"""What the local runner measures before it spreads the clients over processes: the model's bytes.

A built-in model (MLP, CNN) on data whose shape the spec states (a built-in source, or clients'
own data with a schema) is sized by arithmetic here (``builtin_model_bytes``), as the zoo builds
it. Anything else needs the model built, and ``fedcore run`` does not import torch itself (its
start would wait on it): a user's model (``spec.model.kind: Import``), or a built-in one on data
only the roles read, is measured in a child forked from the roles' warm forkserver. The child
loads the manifest, reads the data's shapes (``dataset_info``: no example) and builds the model
on torch's meta device (``fedcore.learning.models.model_bytes``: no storage). It answers with
one decimal number over a pipe (nothing is unpickled from it); any failure answers nothing, and
the roles then report the real error themselves.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import threading
from multiprocessing.connection import Connection
from pathlib import Path

from fedcore.spec import FederatedRunSpec
from fedcore.spec._datasets import BUILTIN_DATASETS

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


def builtin_model_bytes(spec: FederatedRunSpec) -> int | None:
    """The bytes of the weights ``fedcore.learning.models.build_model`` makes for a built-in
    model, by arithmetic (no torch); None for a user's model, or data whose shape only its
    roles can read."""
    model = spec.model
    if model.kind == "Import":
        return None
    schema = spec.data.schema_
    if spec.data.client_data is not None and schema is not None:
        shape, classes = schema.input_shape, len(schema.labels)
    elif spec.data.client_data is None and spec.data.source.kind in BUILTIN_DATASETS:
        facts = BUILTIN_DATASETS[spec.data.source.kind]
        shape, classes = facts.input_shape, facts.classes
    else:
        return None
    bias = 1 if model.bias else 0
    if model.kind == "MLP":
        widths = [math.prod(shape), *model.hidden, classes]
        count = sum(a * b + bias * b for a, b in itertools.pairwise(widths))
    else:  # CNN: 3x3 convolutions, each followed by a 2x2 pool while the map is 2x2 or more
        if len(shape) != 3:
            return None  # the zoo refuses it; the roles say why
        channels, height, width = shape
        count = 0
        for out in model.channels:
            count += out * channels * 9 + bias * out
            if height >= 2 and width >= 2:
                height, width = height // 2, width // 2
            channels = out
        count += channels * height * width * classes + bias * classes
    return count * _DTYPE_BYTES[model.dtype]


_DTYPE_BYTES = {"float32": 4, "float64": 8}


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
