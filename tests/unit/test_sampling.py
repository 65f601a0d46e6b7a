"""Client sampling: seeded by (seed, round) or secret, uniform without replacement."""

from __future__ import annotations

from collections import Counter

from fedcore.privacy.sampling import sample_clients, sampling_rate
from fedcore.spec import ClientsSpec


def test_sample_clients_all_when_per_round_is_everyone() -> None:
    # Prepare
    clients = ClientsSpec(count=5, per_round="100%")
    # Execute / Assert
    assert sample_clients(clients, seed=1, round=3) == [0, 1, 2, 3, 4]
    assert sampling_rate(clients) == 1.0


def test_sample_clients_is_deterministic_per_seed_and_round() -> None:
    # Prepare
    clients = ClientsSpec(count=100, per_round=10)
    # Execute
    first = sample_clients(clients, seed=7, round=4)
    again = sample_clients(clients, seed=7, round=4)
    other_round = sample_clients(clients, seed=7, round=5)
    other_seed = sample_clients(clients, seed=8, round=4)
    # Assert
    assert first == again
    assert first != other_round and first != other_seed
    assert len(first) == 10 and len(set(first)) == 10 and first == sorted(first)
    assert all(0 <= i < 100 for i in first)


def test_sample_clients_percentage_rounds_up_and_rate_matches() -> None:
    # Prepare
    clients = ClientsSpec(count=10, per_round="33%")
    # Execute
    picked = sample_clients(clients, seed=0, round=1)
    # Assert
    assert len(picked) == 4
    assert sampling_rate(clients) == 0.4


def test_sample_clients_is_roughly_uniform_over_many_rounds() -> None:
    # Prepare
    clients = ClientsSpec(count=10, per_round=2)
    # Execute
    counts = Counter(i for r in range(1, 2001) for i in sample_clients(clients, seed=3, round=r))
    # Assert: each client expected 400 times; 5 sigma is about 90.
    assert set(counts) == set(range(10))
    assert all(300 < n < 500 for n in counts.values())


def test_secret_sample_is_not_a_function_of_the_seed_and_round() -> None:
    # Prepare
    clients = ClientsSpec(count=100, per_round=10, sampling="Secret")
    seeded = ClientsSpec(count=100, per_round=10)
    # Execute: the same (seed, round) asked 20 times.
    draws = [tuple(sample_clients(clients, seed=7, round=4)) for _ in range(20)]
    # Assert: fixed size, distinct, ascending, in range; not repeated (two equal samples of
    # 10 of 100 have probability 1 / C(100, 10), about 6e-14) and not the seeded draw.
    assert all(len(set(d)) == 10 and list(d) == sorted(d) for d in draws)
    assert all(0 <= i < 100 for d in draws for i in d)
    assert len(set(draws)) == 20
    assert tuple(sample_clients(seeded, seed=7, round=4)) not in draws
    assert sampling_rate(clients) == 0.1


def test_secret_sample_is_roughly_uniform() -> None:
    # Prepare
    clients = ClientsSpec(count=10, per_round=2, sampling="Secret")
    # Execute
    counts = Counter(i for _ in range(2000) for i in sample_clients(clients, seed=3, round=1))
    # Assert: each client expected 400 times; 5 sigma is about 90.
    assert set(counts) == set(range(10))
    assert all(300 < n < 500 for n in counts.values())


def test_secret_sample_of_everyone_is_everyone() -> None:
    # Execute / Assert
    clients = ClientsSpec(count=4, sampling="Secret")
    assert sample_clients(clients, seed=0, round=1) == [0, 1, 2, 3]
