"""Which clients take part in a round: uniform without replacement, seeded by (seed, round)."""

from __future__ import annotations

import numpy as np

from fedcore.spec import ClientsSpec

SAMPLING_STREAM = 0x5A4D
"""Keeps the sampling random stream apart from every other use of the run's seed."""


def sample_clients(clients: ClientsSpec, *, seed: int, round: int) -> list[int]:
    """Returns the ascending indices of the clients sampled for ``round``.

    The draw depends only on (seed, round), so a resumed run samples exactly as the
    uninterrupted one did, and the DP accountant's sampling rate is ``sampling_rate(clients)``.
    """
    count = clients.count
    take = min(clients.sampled_per_round(), count)
    if take == count:
        return list(range(count))
    rng = np.random.default_rng([seed, round, SAMPLING_STREAM])
    return sorted(int(i) for i in rng.choice(count, size=take, replace=False))


def sampling_rate(clients: ClientsSpec) -> float:
    """Returns the share of clients sampled per round (the accountant's q)."""
    return min(clients.sampled_per_round(), clients.count) / clients.count
