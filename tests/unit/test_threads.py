"""simulate() runs the maths at the role processes' thread count, and gives the count back."""

from __future__ import annotations

import torch
from threadpoolctl import threadpool_info

from fedcore.local.threads import ROLE_THREADS, threads_limited
from fedcore.simulation import Observer, simulate
from fedcore.spec import load_manifest
from fedcore.transport import Payload

MANIFEST = """
apiVersion: fedcore.dev/v1alpha1
kind: FederatedRun
metadata: {name: unit-threads}
spec:
  protocol: {name: fedsgd}
  model: {kind: MLP, hidden: [8], bias: false, dtype: float64}
  clients: {count: 2}
  rounds: 1
  training: {loss: MSE, optimizer: {kind: SGD, learningRate: 0.5}}
"""


def blas_threads() -> list[int]:
    """The thread count of every BLAS library loaded in this process."""
    return [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]


class ThreadProbe(Observer):
    """Records torch's and the BLAS libraries' thread counts when each upload is made."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, list[int]]] = []

    def on_upload(self, round: int, client: int, upload: Payload) -> None:
        self.seen.append((torch.get_num_threads(), blas_threads()))


def test_simulation_runs_the_maths_at_the_roles_threads_and_restores_them() -> None:
    # Prepare: a process with more threads than a role has (a test, a notebook).
    run = load_manifest("unit-threads", text=MANIFEST)
    probe = ThreadProbe()
    with threads_limited(ROLE_THREADS + 1):
        before = (torch.get_num_threads(), blas_threads())
        # Execute
        simulate(run, observer=probe)
        after = (torch.get_num_threads(), blas_threads())
    # Assert: each client's upload was computed at the roles' count, as in `fedcore run`.
    assert before[0] == ROLE_THREADS + 1 and before[1]
    assert all(count == ROLE_THREADS + 1 for count in before[1])
    assert probe.seen == [(ROLE_THREADS, [ROLE_THREADS] * len(before[1]))] * 2
    assert after == before
