"""The allocator's thresholds in a role process: counted in page faults, not timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fedcore.local import allocator

# Two message-sized buffers alive at once, then freed, 200 times (a client holding its task
# while it encodes its upload): the page faults it took, in a fresh interpreter.
_PROBE = """
import json, resource, sys
from fedcore.local.allocator import tune_allocator
tuned = tune_allocator() if sys.argv[1] == "tune" else False
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(200):
    task = b"\\x01" * 400_000
    upload = b"\\x02" * 400_000
    del task, upload
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"tuned": tuned, "faults": faults}))
"""


def _probe(mode: str, **env: str) -> dict[str, object]:
    clean = {k: v for k, v in os.environ.items() if k not in allocator.USER_KNOBS}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, mode],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    result: dict[str, object] = json.loads(done.stdout)
    return result


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tuned_thresholds_keep_message_sized_buffers_from_faulting_in_fresh_pages() -> None:
    tuned = _probe("tune")
    untuned = _probe("default")
    assert tuned["tuned"] is True
    # 200 turns of two 400 KB buffers are about 39,000 pages: the defaults fault most of
    # them in again at every turn; tuned, the freed buffers are reused.
    assert isinstance(tuned["faults"], int) and tuned["faults"] < 2_000
    assert isinstance(untuned["faults"], int) and untuned["faults"] > 10 * tuned["faults"]


def test_an_allocator_configured_by_the_environment_is_left_alone() -> None:
    probed = _probe("tune", MALLOC_TRIM_THRESHOLD_="131072")
    assert probed["tuned"] is False


def test_tune_allocator_is_idempotent() -> None:
    first = allocator.tune_allocator()
    assert allocator.tune_allocator() is first


def test_a_role_process_settles_its_threads_and_its_allocator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fedcore.roles import _common

    calls: list[object] = []
    monkeypatch.setattr(_common, "limit_threads", lambda threads: calls.append(threads))
    monkeypatch.setattr(_common, "tune_allocator", lambda: calls.append("allocator"))
    _common.settle_role_process(3)
    assert calls == [3, "allocator"]
