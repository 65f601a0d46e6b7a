"""The robustness knobs of the spec: ebscfl's preconditions, spec.attack, spec.data.clusters and
fedavg's aggregators; and what they do to the data (clusters, label flips, root data)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fedcore.errors import SpecError
from fedcore.learning.data import client_dataset, root_shards, test_dataset
from fedcore.learning.data._sources import load_split
from fedcore.learning.poisoning import attack_of, attackers, poison_update, tamper
from fedcore.spec import load_manifest

BASE = """
apiVersion: fedcore.dev/v1alpha1
kind: FederatedRun
metadata: {name: robust}
spec:
  protocol: %(protocol)s
  model: {kind: MLP, hidden: [8]}
  data: %(data)s
  clients: %(clients)s
  rounds: 2
%(extra)s
"""


def manifest(
    protocol: str = "{name: ebscfl}",
    *,
    data: str = "{}",
    clients: str = "{count: 6}",
    extra: str = "",
) -> Any:
    text = BASE % {"protocol": protocol, "data": data, "clients": clients, "extra": extra}
    return load_manifest("robust.yaml", text=text)


def issues(*args: str, **kwargs: Any) -> dict[str, str]:
    with pytest.raises(SpecError) as caught:
        manifest(*args, **kwargs)
    return {issue.path: issue.message for issue in caught.value.issues}


def test_a_valid_ebscfl_manifest_with_an_attack_loads() -> None:
    run = manifest(
        "{name: ebscfl, ebscfl: {mode: Faithful, clusters: 3, layout: Flat}}",
        data="{clusters: {count: 3}}",
        extra="  attack: {kind: SignFlip, fraction: 0.4, scale: 5}",
    )
    assert run.spec.protocol.ebscfl.clusters == 3
    assert run.spec.attack is not None and run.spec.attack.kind == "SignFlip"


def test_ebscfl_needs_two_clients_per_round() -> None:
    found = issues(clients="{count: 6, perRound: 1}")
    assert "at least 2" in found["spec.clients.perRound"]
    found = issues(clients="{count: 6, quorum: 1}")
    assert "at least 2" in found["spec.clients.quorum"]


def test_ebscfl_refuses_srfc_matrices_too_wide_and_repaired_with_a_1x1_block() -> None:
    found = issues("{name: ebscfl, ebscfl: {segmentLength: 400, clusters: 4}}")
    assert "2*t*m*n" in found["spec.protocol.ebscfl.segmentLength"]
    found = issues("{name: ebscfl, ebscfl: {mode: Repaired, clusters: 1}}")
    assert "t*m >= 2" in found["spec.protocol.ebscfl.mode"]
    assert manifest("{name: ebscfl, ebscfl: {mode: Faithful, clusters: 1}}")


def test_attacks_are_refused_where_no_client_applies_them() -> None:
    found = issues("{name: mpdp}", extra="  attack: {kind: SignFlip}")
    assert "'LabelFlip'" in found["spec.attack.kind"]
    found = issues("{name: fedavg}", extra="  attack: {kind: MalformedEncoding}")
    assert "ebscfl" in found["spec.attack.kind"]
    found = issues("{name: ebscfl}", extra="  attack: {kind: Drop}")
    assert "spec.attack.kind" in found
    found = issues("{name: ebscfl}", extra="  attack: {kind: Scale, fraction: 1.0}")
    assert "spec.attack.fraction" in found


def test_fedavg_aggregator_preconditions_name_their_fields() -> None:
    found = issues("{name: fedavg, fedavg: {aggregator: Krum, krumByzantine: 4}}")
    assert "f + 3" in found["spec.protocol.fedavg.krumByzantine"]
    found = issues("{name: fedavg, fedavg: {aggregator: FLTrust, clusters: 2}}")
    assert "clusters 1" in found["spec.protocol.fedavg.aggregator"]
    found = issues("{name: fedavg, fedavg: {aggregator: Average}}")
    assert "'Median'" in found["spec.protocol.fedavg.aggregator"]


def test_attackers_are_a_seeded_share_of_the_clients() -> None:
    run = manifest(
        "{name: fedavg}",
        clients="{count: 10}",
        extra="  attack: {kind: LabelFlip, fraction: 0.4, seed: 3}",
    )
    chosen = attackers(run.spec)
    assert len(chosen) == 4 and chosen == attackers(run.spec)
    assert all(attack_of(run.spec, k) == ("LabelFlip" if k in chosen else None) for k in range(10))
    assert attackers(manifest("{name: fedavg}").spec) == frozenset()


def test_poisoned_updates_and_tampered_encodings() -> None:
    update = np.array([1.0, -2.0])
    np.testing.assert_allclose(poison_update(update, "SignFlip", 3.0), [-3.0, 6.0])
    np.testing.assert_allclose(poison_update(update, "Scale", 3.0), [3.0, -6.0])
    np.testing.assert_allclose(poison_update(update, "LabelFlip", 3.0), update)
    upload = np.ones((4, 3))
    noisy = tamper(upload, 0.5, seed=1, round=2, client=3)
    assert np.linalg.norm(noisy - upload) == pytest.approx(0.5 * np.linalg.norm(upload))


def test_data_clusters_relabel_shards_and_copy_the_test_split_per_cluster() -> None:
    # Prepare
    run = manifest("{name: fedavg}", data="{clusters: {count: 2}}", clients="{count: 4}")
    plain = manifest("{name: fedavg}", clients="{count: 4}")
    # Execute
    shard0, shard1 = client_dataset(run.spec, 0), client_dataset(run.spec, 1)
    base0, base1 = client_dataset(plain.spec, 0), client_dataset(plain.spec, 1)
    test, base_test = test_dataset(run.spec), test_dataset(plain.spec)
    # Assert: cluster 0 as is, cluster 1 shifted by one; the test split twice, in order
    np.testing.assert_array_equal(shard0.y, base0.y)
    np.testing.assert_array_equal(shard1.y, (base1.y + 1) % 10)
    assert len(test) == 2 * len(base_test)
    np.testing.assert_array_equal(test.y[len(base_test) :], (base_test.y + 1) % 10)


def test_label_flip_attackers_flip_their_own_labels() -> None:
    run = manifest(
        "{name: fedavg}", clients="{count: 4}", extra="  attack: {kind: LabelFlip, fraction: 0.5}"
    )
    plain = manifest("{name: fedavg}", clients="{count: 4}")
    for k in range(4):
        flipped = k in attackers(run.spec)
        expected = (
            9 - client_dataset(plain.spec, k).y if flipped else client_dataset(plain.spec, k).y
        )
        np.testing.assert_array_equal(client_dataset(run.spec, k).y, expected)


def test_root_data_is_a_seeded_sample_dealt_to_the_clusters() -> None:
    run = manifest("{name: ebscfl}", data="{clusters: {count: 3}}")
    shards = root_shards(run.spec, 60)
    train, _ = load_split(run.spec.data)
    assert [c for c, _ in shards] == [0, 1, 2] and sum(len(s) for _, s in shards) == 60
    assert root_shards(run.spec, 60)[1][1].y.tolist() == shards[1][1].y.tolist()
    assert len(root_shards(run.spec, 10**6)[0][1]) == -(-len(train) // 3)
