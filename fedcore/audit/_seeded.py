"""The run as every audit simulates it: a secret sample replaced by the seeded one."""

from __future__ import annotations

from fedcore.spec import FederatedRun


def audited(run: FederatedRun) -> FederatedRun:
    """The run as the audit simulates it: a secret sample replaced by the seeded one.

    The audit's attacker observes the round's messages, so it sees who takes part, and a
    secret sample claims nothing against such an observer: the seeded sample lets the audit
    choose its attacker among the clients of the rounds it records and be reproduced, and its
    epsilon is then the public sample's bound, the one that holds against that attacker.
    """
    clients = run.spec.clients
    if clients.sampling != "Secret":
        return run
    seeded = clients.model_copy(update={"sampling": "Seeded"})
    return run.model_copy(update={"spec": run.spec.model_copy(update={"clients": seeded})})
