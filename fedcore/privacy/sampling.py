"""Which clients take part in a round: uniform without replacement, seeded or secret."""

from __future__ import annotations

import secrets

import numpy as np

from fedcore.spec import ClientsSpec

SAMPLING_STREAM = 0x5A4D
"""Keeps the sampling random stream apart from every other use of the run's seed."""

_SECRET = secrets.SystemRandom()
"""The operating system's CSPRNG, for ``spec.clients.sampling: Secret``."""


def sample_clients(clients: ClientsSpec, *, seed: int, round: int) -> list[int]:
    """Returns the ascending indices of the clients sampled for ``round``.

    ``Seeded`` sampling depends only on (seed, round), so a resumed run samples exactly as the
    uninterrupted one did, and anyone with the manifest can tell who took part. ``Secret``
    sampling draws a uniformly random set of the same size from the OS CSPRNG at every call.
    Either way ``sampling_rate(clients)`` is the share of clients taken.
    """
    count = clients.count
    take = min(clients.sampled_per_round(), count)
    if take == count:
        return list(range(count))
    if clients.sampling == "Secret":
        return sorted(_SECRET.sample(range(count), take))
    rng = np.random.default_rng([seed, round, SAMPLING_STREAM])
    return sorted(int(i) for i in rng.choice(count, size=take, replace=False))


def sampling_rate(clients: ClientsSpec) -> float:
    """Returns the share of clients sampled per round (the accountant's q)."""
    return min(clients.sampled_per_round(), clients.count) / clients.count
