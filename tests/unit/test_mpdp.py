"""mpdp (digest 000) in one process: samplers, recovery, masks, keys, dropout, what reaches whom."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import rdp
from scipy import stats

from fedcore.errors import MessageRejected, NotReady, ProtocolError
from fedcore.learning.data import ArrayDataset, client_dataset, test_dataset
from fedcore.learning.models import build_model, get_weights
from fedcore.learning.training import LocalLearner
from fedcore.protocols import KeyChannel, create_protocol
from fedcore.protocols.mpdp import keys as keys_
from fedcore.protocols.mpdp import maths
from fedcore.protocols.mpdp.protocol import Mpdp, MpdpClient, MpdpKdc, MpdpServer
from fedcore.simulation import LocalKeyChannel, simulate
from fedcore.spec import FederatedRun, FederatedRunSpec, load_manifest
from fedcore.transport import Identity, Payload, encode_chunks

MANIFEST = """
apiVersion: fedcore.dev/v1alpha1
kind: FederatedRun
metadata: {name: unit-mpdp}
spec:
  protocol:
    name: %(protocol)s
    fedsgd: {weighting: Uniform}
    mpdp: {mode: %(mode)s, graph: %(graph)s, graphDegree: 1, clientNoiseStd: %(noise)s,
           clippingNorm: %(clip)s, outputNoiseStd: %(output)s}
  model: {kind: MLP, hidden: %(hidden)s, bias: false, dtype: float64}
  clients: {count: %(clients)s, quorum: %(quorum)s}
  rounds: %(rounds)s
  training: {loss: MSE, optimizer: {kind: SGD, learningRate: %(rate)s}}
  seed: 5
"""


def run_for(
    protocol: str = "mpdp",
    *,
    mode: str = "Hardened",
    graph: str = "NOut",
    noise: float = 0.0,
    clip: float = 1.0,
    hidden: str = "[12]",
    clients: int = 4,
    quorum: str = "'100%'",
    rounds: int = 3,
    rate: float = 0.5,
    output: float = 0.01,
) -> FederatedRun:
    text = MANIFEST % {
        "protocol": protocol,
        "mode": mode,
        "graph": graph,
        "noise": noise,
        "clip": clip,
        "hidden": hidden,
        "clients": clients,
        "quorum": quorum,
        "rounds": rounds,
        "rate": rate,
        "output": output,
    }
    return load_manifest("unit-mpdp", text=text)


def spec_for(**changes: Any) -> FederatedRunSpec:
    return run_for(**changes).spec


def mlp(widths: list[int], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(0, 1 / math.sqrt(a), size=(b, a)) for a, b in itertools.pairwise(widths)]


def true_loss_and_gradient(
    weights: list[np.ndarray], x: torch.Tensor, y: torch.Tensor
) -> tuple[float, list[np.ndarray]]:
    params = [torch.tensor(w, requires_grad=True) for w in weights]
    h = x
    for w in params[:-1]:
        h = torch.relu(h @ w.T)
    loss = torch.nn.functional.mse_loss(h @ params[-1].T, y)
    loss.backward()
    return float(loss.detach()), [p.grad.numpy() for p in params]  # type: ignore[union-attr]


def batch(widths: list[int], n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    x = torch.tensor(rng.uniform(0, 1, size=(n, widths[0])))
    labels = torch.tensor(rng.integers(0, widths[-1], size=n))
    return x, torch.nn.functional.one_hot(labels, widths[-1]).double()


class RecordingChannel(KeyChannel):
    """A key channel to an in-process KDC that keeps every payload submitted."""

    def __init__(self, kdc: MpdpKdc, party: Identity, sent: list[Payload]) -> None:
        self._inner = LocalKeyChannel(kdc, party)
        self._sent = sent

    def submit(self, payload: Payload) -> Payload:
        self._sent.append(payload)
        return self._inner.submit(payload)


@dataclass
class Federation:
    """A server, a KDC and every client of a spec, wired in one process."""

    spec: FederatedRunSpec
    server: MpdpServer
    kdc: MpdpKdc
    clients: dict[int, MpdpClient]
    learners: dict[int, LocalLearner]
    submitted: list[Payload] = field(default_factory=list)

    @classmethod
    def of(cls, spec: FederatedRunSpec) -> Federation:
        protocol = create_protocol("mpdp")
        data = client_dataset(spec, 0)
        model = build_model(spec.model, data.input_shape, data.num_classes, seed=spec.seed)
        server = protocol.create_server(spec, get_weights(model))
        kdc = protocol.create_kdc(spec)
        assert isinstance(server, MpdpServer) and isinstance(kdc, MpdpKdc)
        fed = cls(spec, server, kdc, {}, {})
        for k in range(spec.clients.count):
            client = protocol.create_client(spec, k)
            assert isinstance(client, MpdpClient)
            client.setup(RecordingChannel(kdc, Identity("client", k), fed.submitted))
            fed.clients[k] = client
            shard = client_dataset(spec, k)
            net = build_model(spec.model, shard.input_shape, shard.num_classes, seed=spec.seed)
            fed.learners[k] = LocalLearner(
                net, shard, spec.training, seed=spec.seed, client_index=k
            )
        return fed

    def uploads(
        self, round: int, plans: Mapping[int, Payload], *, fetched: list[int] | None = None
    ) -> dict[int, Payload]:
        """Every planned client's upload; with ``fetched``, each client first asks for its
        reusable keys, as the client role does, and the KDC is called (and the client recorded
        in ``fetched``) only when it has none."""
        result = {}
        for k, instruction in plans.items():
            keys = None
            if fetched is not None:
                keys = self.clients[k].reusable_keys(round, instruction)
            if keys is None:
                keys = self.kdc.issue_keys(round, Identity("client", k))
                if fetched is not None:
                    fetched.append(k)
            result[k] = self.clients[k].compute_upload(round, instruction, self.learners[k], keys)
        return result

    def fedsgd_step(self, weights: dict[str, np.ndarray], members: list[int]) -> dict[str, Any]:
        grads = [self.learners[k].gradient(weights, round=1)[0] for k in members]
        rate = self.spec.training.optimizer.learning_rate
        return {n: weights[n] - rate * sum(g[n] for g in grads) / len(grads) for n in weights}


# ------------------------------------------------------------------------------ samplers


def test_server_noise_factors_have_dn_star_laws_and_are_positive() -> None:
    # Prepare
    rng = np.random.default_rng(0)
    n = 20_000
    sigma = 1.7
    # Execute
    single = maths.dn_star_1(rng, n)
    pair = maths.dn_star_pair_r(rng, n) * maths.dn_star_pair_s(rng, n)
    bits = rng.integers(0, 2**64, size=n, dtype=np.uint64)
    noise = maths.dn_from_bits(bits, sigma)
    hardened = maths.log_uniform(rng, n, maths.HARDENED_SCALE_MAX)
    # Assert: |DN*(1)| = sqrt(Gamma(3/2)); the Gamma(3/4), Gamma(5/4) pair has the same law;
    # DN(sigma, 1) is uniform on [-sqrt(2) sigma, sqrt(2) sigma]; products are N(0, sigma^2).
    assert single.min() > 0 and pair.min() > 0 and hardened.min() >= 1.0
    assert hardened.max() <= maths.HARDENED_SCALE_MAX
    assert stats.ks_2samp(single, np.sqrt(rng.gamma(1.5, size=n))).pvalue > 0.01
    assert stats.ks_2samp(single, pair).pvalue > 0.01
    assert np.abs(noise).max() <= math.sqrt(2) * sigma
    assert (
        stats.kstest(
            noise, stats.uniform(-math.sqrt(2) * sigma, 2 * math.sqrt(2) * sigma).cdf
        ).pvalue
        > 0.01
    )
    for product in (single * noise, pair * noise):
        assert stats.kstest(product / sigma, "norm").pvalue > 0.01
        assert product.std() == pytest.approx(sigma, rel=0.03)


@pytest.mark.parametrize("gaussian", [True, False])
def test_a_pairs_noise_row_is_the_same_bits_alone_or_in_any_batch(gaussian: bool) -> None:
    # Prepare: three pair seeds; each end of a pair draws its row in a batch of its own.
    seeds = [bytes([k]) * 32 for k in (1, 2, 3)]
    words = maths.noise_words(4736)
    # Execute
    alone = [
        maths.unit_noise(keys_.keystreams([(seed, keys_.STREAM_DELTA)], words), gaussian=gaussian)
        for seed in seeds
    ]
    batch = maths.unit_noise(
        keys_.keystreams([(seed, keys_.STREAM_DELTA) for seed in seeds], words),
        gaussian=gaussian,
    )
    tail = keys_.keystreams([(seeds[2], keys_.STREAM_DELTA)], 1024, offset=words - 1024)
    # Assert: bit for bit, and a slice taken at an offset is that part of the stream.
    for row, single in enumerate(alone):
        np.testing.assert_array_equal(batch[row], single[0])
    np.testing.assert_array_equal(maths.unit_noise(tail, gaussian=gaussian)[0], alone[2][0, -1024:])
    draws = batch.ravel() / (1.0 if gaussian else math.sqrt(2.0))
    assert (
        abs(draws.mean()) < 0.05
        and abs(draws.std() - (1.0 if gaussian else 1 / math.sqrt(3))) < 0.05
    )


def test_gaussian_from_bits_is_standard_normal_scaled() -> None:
    # Prepare
    bits = np.random.default_rng(1).integers(0, 2**64, size=40_000, dtype=np.uint64)
    # Execute
    draws = maths.gaussian_from_bits(bits, 0.5)
    # Assert
    assert len(draws) == 20_000
    assert stats.kstest(draws / 0.5, "norm").pvalue > 0.01


# ---------------------------------------------------------------------- MP_Server, LMT, MU


@pytest.mark.parametrize("hardened", [False, True], ids=["Faithful", "Hardened"])
@pytest.mark.parametrize("widths", [[6, 5, 3], [6, 5, 4, 3], [7, 4, 6, 5, 2]])
def test_recovery_of_perturbed_gradient_and_loss_is_exact(
    hardened: bool, widths: list[int]
) -> None:
    # Prepare
    weights = mlp(widths, seed=len(widths))
    x, y = batch(widths, n=9, seed=2)
    secrets = maths.draw_perturbation(
        np.random.default_rng(3), widths, hardened=hardened, shift_std=0.5
    )
    loss, expected = true_loss_and_gradient(weights, x, y)
    # Execute
    odd = maths.perturb(weights, secrets)
    terms = maths.local_terms(odd, secrets.transitional(), x, y)
    recovered = maths.recover(terms.gradient, terms.psi, terms.phi, secrets)
    # Assert: Thm 4 / Thm 13 with the n_L + 2 VJP form; the perturbed model differs.
    scale = max(float(np.abs(g).max()) for g in expected)
    for got, want, w, w_hat in zip(recovered, expected, weights, odd, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-10 * scale)
        assert not np.allclose(w, w_hat)
    assert maths.recover_loss(terms.terms, secrets) == pytest.approx(loss, rel=1e-10)
    assert terms.psi[0].shape == (widths[-1], *weights[0].shape)


def test_perturbed_output_is_true_output_plus_alpha_shift() -> None:
    # Prepare: Thm 12's output identity, checked through the loss scalars.
    widths = [5, 4, 3]
    weights = mlp(widths, seed=7)
    x, _ = batch(widths, n=6, seed=8)
    secrets = maths.draw_perturbation(np.random.default_rng(9), widths, hardened=False, shift_std=1)
    odd = maths.perturb(weights, secrets)
    # Execute
    h = torch.relu(x @ torch.tensor(odd[0]).T) * torch.tensor(secrets.transitional()[0])
    perturbed = (h @ torch.tensor(odd[1]).T).numpy()
    alpha = h.sum(dim=1).numpy()
    true = (torch.relu(x @ torch.tensor(weights[0]).T) @ torch.tensor(weights[1]).T).numpy()
    # Assert
    np.testing.assert_allclose(perturbed, true + alpha[:, None] * secrets.shift, atol=1e-12)


@pytest.mark.parametrize("hardened", [False, True], ids=["Faithful", "Hardened"])
def test_norm_bound_bounds_the_recovered_norm_and_scaling_clips_it(hardened: bool) -> None:
    # Prepare
    widths = [8, 6, 5, 4]
    rng = np.random.default_rng(11)
    for trial in range(5):
        weights = mlp(widths, seed=trial)
        x, y = batch(widths, n=10, seed=trial)
        secrets = maths.draw_perturbation(rng, widths, hardened=hardened, shift_std=0.3)
        terms = maths.local_terms(maths.perturb(weights, secrets), secrets.transitional(), x, y)
        layer_bounds, shift_bound = maths.scale_bounds(secrets)
        # Execute
        bound = maths.norm_bound(terms, layer_bounds, shift_bound)
        clip = 0.1 * bound
        clipped = terms.scaled(clip / bound)
        norm = math.sqrt(
            sum(
                float((g**2).sum())
                for g in maths.recover(terms.gradient, terms.psi, terms.phi, secrets)
            )
        )
        clipped_norm = math.sqrt(
            sum(
                float((g**2).sum())
                for g in maths.recover(clipped.gradient, clipped.psi, clipped.phi, secrets)
            )
        )
        # Assert
        assert norm <= bound
        assert clipped_norm <= clip * (1 + 1e-12)
        assert clipped_norm == pytest.approx(0.1 * norm, rel=1e-9)


def test_fixed_point_masks_cancel_exactly_and_overflow_is_refused() -> None:
    # Prepare
    rng = np.random.default_rng(4)
    values = [rng.normal(0, 100, size=50) for _ in range(3)]
    masks = [rng.integers(0, 2**64, size=50, dtype=np.uint64) for _ in range(2)]
    # Execute: client 0 adds mask 0, client 1 subtracts it and adds mask 1, client 2 subtracts.
    words = [maths.encode_fixed(v, parties=3) for v in values]
    words[0] = words[0] + masks[0]
    words[1] = words[1] - masks[0] + masks[1]
    words[2] = words[2] - masks[1]
    total = np.zeros(50, dtype=np.uint64)
    for w in words:
        total += w
    # Assert
    np.testing.assert_allclose(maths.decode_fixed(total), sum(values), rtol=0, atol=3 * 2.0**-32)
    with pytest.raises(ProtocolError, match="overflow"):
        maths.encode_fixed(np.array([2.0**31]), parties=2)


# --------------------------------------------------------------------------- keys, masks


def test_x25519_pair_seed_is_shared_by_both_ends_and_unique_per_pair_and_round() -> None:
    # Prepare
    private = {k: keys_.new_private_key() for k in range(4)}
    public = {k: keys_.public_bytes(key) for k, key in private.items()}

    def seed(a: int, b: int, round: int = 1, run: str = "r") -> bytes:
        return keys_.pair_seed(private[a], public[b], run=run, round=round, pair=(a, b))

    # Execute
    seeds = {(a, b): seed(a, b) for a in range(4) for b in range(a + 1, 4)}
    # Assert
    for (a, b), value in seeds.items():
        assert value == seed(b, a) and len(value) == 32
    assert len(set(seeds.values())) == len(seeds)
    assert seed(0, 1, round=2) != seed(0, 1) and seed(0, 1, run="other") != seed(0, 1)


@pytest.mark.parametrize("kind", ["Complete", "NOut"])
@pytest.mark.parametrize("size", [2, 3, 5, 9])
def test_pairwise_masks_cancel_in_the_sum(kind: str, size: int) -> None:
    # Prepare
    members = list(range(10, 10 + size))
    private = {k: keys_.new_private_key() for k in members}
    public = {k: keys_.public_bytes(key) for k, key in private.items()}
    graph = keys_.mask_graph(members, kind=kind, degree=2, run="r", round=3)
    n = 1000
    total = np.zeros(n)
    words = np.zeros(n, dtype=np.uint64)
    largest = 0.0
    # Execute
    for k in members:
        for v in graph[k]:
            seed = keys_.pair_seed(private[k], public[v], run="r", round=3, pair=(k, v))
            delta = maths.gaussian_from_bits(keys_.keystream(seed, keys_.STREAM_DELTA, 2 * n), 5)
            mask = keys_.keystream(seed, keys_.STREAM_CORRECTIONS, n)
            total += delta if k < v else -delta
            words = words + mask if k < v else words - mask
            largest = max(largest, float(np.abs(delta).max()))
    # Assert
    for k in members:  # symmetric, no self loops, each picked its n
        assert all(k in graph[v] and v != k for v in graph[k])
        assert len(graph[k]) >= (size - 1 if kind == "Complete" else min(2, size - 1))
    assert largest > 1.0
    assert np.abs(total).max() <= 1e-12
    assert not words.any()


def test_mask_graph_is_the_same_for_everyone_and_new_for_another_participant_set() -> None:
    # Prepare
    members = list(range(12))
    # Execute
    first = keys_.mask_graph(members, kind="NOut", degree=2, run="r", round=1)
    again = keys_.mask_graph(list(reversed(members)), kind="NOut", degree=2, run="r", round=1)
    other = keys_.mask_graph(members[:-1], kind="NOut", degree=2, run="r", round=1)
    # Assert
    assert first == again
    assert set(other) == set(members[:-1]) and all(11 not in vs for vs in other.values())
    assert sum(len(v) for v in first.values()) < 12 * 11  # sparse


# ------------------------------------------------------------------------ whole protocol


@pytest.mark.parametrize("mode", ["Faithful", "Hardened"])
def test_noise_off_equals_fedsgd_uniform_over_several_rounds(mode: str) -> None:
    # Prepare
    mpdp = run_for(mode=mode, rounds=4)
    fedsgd = run_for(protocol="fedsgd", rounds=4)
    # Execute
    ours = simulate(mpdp)
    reference = simulate(fedsgd)
    # Assert
    for name, weights in reference.weights.items():
        np.testing.assert_allclose(ours.weights[name], weights, rtol=0, atol=1e-9)
    for mine, theirs in zip(ours.history, reference.history, strict=True):
        assert mine["train_loss"] == pytest.approx(theirs["train_loss"], abs=1e-9)


@pytest.mark.parametrize("mode", ["Faithful", "Hardened"])
def test_redo_with_survivors_gives_their_fedsgd_aggregate_and_refuses_old_uploads(
    mode: str,
) -> None:
    # Prepare
    fed = Federation.of(spec_for(mode=mode, graph="Complete", clients=4))
    before = {n: w.copy() for n, w in fed.server.global_weights().items()}
    first = fed.uploads(1, fed.server.plan_round(1, [0, 1, 2, 3]))
    for k in (0, 1, 2):
        fed.server.check_upload(1, k, first[k])
    # Execute: client 3 drops; the round is planned again with the survivors.
    second = fed.uploads(1, fed.server.plan_round(1, [0, 1, 2]))
    with pytest.raises(ProtocolError, match="attempt"):
        fed.server.check_upload(1, 0, first[0])
    with pytest.raises(ProtocolError, match="outside the attempt"):
        fed.server.check_upload(1, 3, first[3])
    for k, upload in second.items():
        fed.server.check_upload(1, k, upload)
    with pytest.raises(ProtocolError, match="would not cancel"):
        fed.server.combine(1, {0: second[0], 1: second[1]}, [2])
    result = fed.server.combine(1, second, [])
    # Assert
    expected = fed.fedsgd_step(before, [0, 1, 2])
    assert result is not None and result.participants == 3
    for name, weights in expected.items():
        np.testing.assert_allclose(fed.server.global_weights()[name], weights, rtol=0, atol=1e-9)


@pytest.mark.parametrize("mode", ["Faithful", "Hardened"])
def test_masks_drawn_ahead_equal_those_drawn_on_demand_and_a_changed_round_draws_afresh(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: round 1 as the client role runs it, then the hook draws round 2's masks ahead.
    fed = Federation.of(spec_for(mode=mode, noise=0.01, clients=4))
    client, learner = fed.clients[0], fed.learners[0]
    keys = fed.kdc.issue_keys(1, Identity("client", 0))
    client.compute_upload(1, fed.server.plan_round(1, [0, 1, 2, 3])[0], learner, keys)
    client.after_upload(1)
    draws: list[int] = []
    draw = client._draw_masks
    monkeypatch.setattr(client, "_draw_masks", lambda context: draws.append(1) or draw(context))
    # Execute: round 2 with the predicted participants, then the same task again, on demand.
    task = fed.server.plan_round(2, [0, 1, 2, 3])[0]
    ahead = client.compute_upload(2, task, learner, keys)
    on_demand = client.compute_upload(2, task, learner, keys)
    # ... and round 3 redone without client 3: the masks drawn ahead do not fit it.
    client.after_upload(2)
    survivors = client.compute_upload(3, fed.server.plan_round(3, [0, 1, 2])[0], learner, keys)
    again = client.compute_upload(3, fed.server.plan_round(3, [0, 1, 2])[0], learner, keys)
    # Assert: the masks drawn ahead were used, bit for bit those drawn on demand.
    assert len(draws) == 1 + 1 + 1 + 1, "drawn for: on demand, ahead of 3, its miss, again"
    assert ahead.meta == on_demand.meta
    for name, tensor in ahead.tensors.items():
        np.testing.assert_array_equal(tensor, on_demand.tensors[name])
    for name in ("g.0", "terms"):
        np.testing.assert_array_equal(survivors.tensors[name], again.tensors[name])


def test_combining_an_earlier_attempts_uploads_is_refused() -> None:
    # Prepare
    fed = Federation.of(spec_for(clients=3))
    first = fed.uploads(1, fed.server.plan_round(1, [0, 1, 2]))
    fed.server.plan_round(1, [0, 1, 2])  # a redo opened before the first could combine
    # Execute / Assert
    with pytest.raises(ProtocolError, match="another attempt"):
        fed.server.combine(1, first, [])


def test_upload_masked_with_other_public_keys_is_refused() -> None:
    # Prepare
    fed = Federation.of(spec_for(clients=3))
    plans = fed.server.plan_round(1, [0, 1, 2])
    early = fed.uploads(1, {0: plans[0]})
    fed.clients[2].setup(LocalKeyChannel(fed.kdc, Identity("client", 2)))  # 2 restarts: new key
    late = fed.uploads(1, {1: plans[1]})
    # Execute
    fed.server.check_upload(1, 0, early[0])
    # Assert
    with pytest.raises(ProtocolError, match="other public keys"):
        fed.server.check_upload(1, 1, late[1])


def test_a_stale_key_table_after_a_restart_costs_one_redo_never_a_wrong_aggregate() -> None:
    # Prepare: round 1 fetches every table; then client 2 restarts with a new key pair.
    fed = Federation.of(spec_for(graph="Complete", clients=4))
    weights = {n: w.copy() for n, w in fed.server.global_weights().items()}
    fetched: list[int] = []
    first = fed.uploads(1, fed.server.plan_round(1, [0, 1, 2, 3]), fetched=fetched)
    for k, upload in first.items():
        fed.server.check_upload(1, k, upload)
    fed.server.combine(1, first, [])
    weights = fed.fedsgd_step(weights, [0, 1, 2, 3])
    assert fetched == [0, 1, 2, 3]
    fed.clients[2].setup(LocalKeyChannel(fed.kdc, Identity("client", 2)))
    # Execute: round 2's first attempt (the others reuse their stale tables), its redo, round 3
    fetched.clear()
    stale = fed.uploads(2, fed.server.plan_round(2, [0, 1, 2, 3]), fetched=fetched)
    reused_in_first_attempt = [k for k in range(4) if k not in fetched]
    for k in (0, 1, 3):
        fed.server.check_upload(2, k, stale[k])
    with pytest.raises(ProtocolError, match="other public keys"):
        fed.server.check_upload(2, 2, stale[2])
    fetched.clear()
    redone = fed.uploads(2, fed.server.plan_round(2, [0, 1, 3]), fetched=fetched)
    fetched_in_redo = list(fetched)
    for k, upload in redone.items():
        fed.server.check_upload(2, k, upload)
    fed.server.combine(2, redone, [])
    weights = fed.fedsgd_step(weights, [0, 1, 3])
    fetched.clear()
    third = fed.uploads(3, fed.server.plan_round(3, [0, 1, 2, 3]), fetched=fetched)
    for k, upload in third.items():
        fed.server.check_upload(3, k, upload)
    fed.server.combine(3, third, [])
    weights = fed.fedsgd_step(weights, [0, 1, 2, 3])
    # Assert: only the restarted client asked the KDC in round 2's first attempt, everyone in
    # the redo, nobody in round 3; every round's model is fedsgd's over its participants.
    assert reused_in_first_attempt == [0, 1, 3]
    assert fetched_in_redo == [0, 1, 3]
    assert fetched == []
    for name, expected in weights.items():
        np.testing.assert_allclose(fed.server.global_weights()[name], expected, rtol=0, atol=1e-9)


def test_no_seed_or_private_key_reaches_the_server_and_the_kdc_sees_only_public_keys() -> None:
    # Prepare
    spec = spec_for(mode="Hardened", graph="Complete", noise=0.5, clients=3)
    fed = Federation.of(spec)
    plans = fed.server.plan_round(1, [0, 1, 2])
    # Execute
    uploads = fed.uploads(1, plans)
    wire = b"".join(
        chunk for u in uploads.values() for chunk in encode_chunks(u, chunk_bytes=1 << 20)
    )
    session = fed.kdc.issue_keys(1, Identity("client", 0)).meta["session"]
    secrets_: list[bytes] = []
    for k, client in fed.clients.items():
        assert client._key is not None and client._secret is not None
        secrets_ += [client._key.private_bytes_raw(), client._secret]
        secrets_.append(keys_.noise_key(client._secret, run=session, round=1, client=k))
        for v in range(3):
            if v != k:
                peer = keys_.public_bytes(fed.clients[v]._key)  # type: ignore[arg-type]
                secrets_.append(
                    keys_.pair_seed(client._key, peer, run=session, round=1, pair=(k, v))
                )
    issued = fed.kdc.issue_keys(1, Identity("client", 1))
    kdc_state = repr(fed.kdc.state_dict()).encode()
    # Assert
    assert len(secrets_) == 3 * 3 + 6
    for secret in secrets_:
        for part in (secret[:16], secret[16:]):
            assert part not in wire
            assert part not in kdc_state
            assert part not in issued.tensors["public_keys"].tobytes()
    assert len(fed.submitted) == 3
    for k, payload in enumerate(fed.submitted):
        assert set(payload.tensors) == {"public_key"} and payload.meta == {
            "kind": "x25519-public-key"
        }
        assert payload.tensors["public_key"].tobytes() == keys_.public_bytes(fed.clients[k]._key)  # type: ignore[arg-type]
    assert set(issued.tensors) == {"public_keys"}
    assert set(issued.meta) == {"round", "clients", "session"}


def server_secret_arrays(secret: maths.Perturbation, true: Mapping[str, np.ndarray]) -> dict:
    """Every array no client may receive: r, s, the shift, upsilon, R (whole and by row), the
    products r o s, and the true weights (whole and by row)."""
    found: dict[str, np.ndarray] = {"shift": secret.shift, "upsilon": np.array([secret.upsilon])}
    for layer, (r, s) in enumerate(zip(secret.r, secret.s, strict=True)):
        found[f"r{layer}"], found[f"s{layer}"], found[f"rs{layer}"] = r, s, r * s
    for (name, weight), multiplier in zip(true.items(), secret.multipliers(), strict=True):
        whole = np.broadcast_to(multiplier, weight.shape)
        for what, array in ((f"R of {name}", whole), (f"true {name}", weight)):
            found[what] = array
            found.update({f"{what} row {row}": array[row] for row in range(array.shape[0])})
    return found


@pytest.mark.parametrize("mode", ["Faithful", "Hardened"])
def test_no_server_secret_reaches_any_client_in_any_round(mode: str) -> None:
    # Prepare
    fed = Federation.of(spec_for(mode=mode, graph="Complete", noise=0.5, clients=3))
    previous: dict[int, Payload] = {}
    for round_ in (1, 2, 3):
        true = {n: w.copy() for n, w in fed.server.global_weights().items()}
        # Execute
        plans = fed.server.plan_round(round_, [0, 1, 2])
        secret = fed.server._secrets
        assert secret is not None
        forbidden = server_secret_arrays(secret, true)
        uploads = fed.uploads(round_, plans)
        # Assert: every client-bound message (instruction and the KDC's keys), as on the wire.
        for k, plan in plans.items():
            keys = fed.kdc.issue_keys(round_, Identity("client", k))
            wire = b"".join(
                chunk for p in (plan, keys) for chunk in encode_chunks(p, chunk_bytes=1 << 20)
            )
            for what, array in forbidden.items():
                raw = np.ascontiguousarray(array, dtype="<f8").tobytes()
                assert raw not in wire, f"client {k} receives {what} in round {round_}"
            if previous:  # fresh secrets every round: the perturbed model changes
                assert not np.array_equal(plan.tensors["w.0"], previous[k].tensors["w.0"])
        previous = dict(plans)
        fed.server.combine(round_, uploads, [])


def test_faithful_mode_leaks_a_single_example_through_phi_hardened_does_not() -> None:
    # Prepare: G6: with one example, Phi^(1) = alpha * d(alpha)/dW^(1) = (vector) x^T.
    spec = spec_for(mode="Faithful", clients=2)
    fed = {mode: Federation.of(spec_for(mode=mode, clients=2)) for mode in ("Faithful", "Hardened")}
    data = client_dataset(spec, 0)
    one = ArrayDataset(data.x[:1], data.y[:1], data.num_classes)
    x = one.x.reshape(-1).astype(np.float64)
    cosines = {}
    for mode, federation in fed.items():
        net = build_model(spec.model, one.input_shape, one.num_classes, seed=spec.seed)
        federation.learners[0] = LocalLearner(net, one, spec.training, seed=1, client_index=0)
        # Execute
        upload = federation.uploads(1, federation.server.plan_round(1, [0, 1]))[0]
        phi = upload.tensors["phi.0"].astype(np.float64)
        row = phi[np.argmax(np.abs(phi).sum(axis=1))]
        cosines[mode] = abs(row @ x) / (np.linalg.norm(row) * np.linalg.norm(x))
    # Assert
    assert cosines["Faithful"] > 0.999
    assert cosines["Hardened"] < 0.9


def test_kdc_waits_for_every_key_and_serves_clients_only() -> None:
    # Prepare
    kdc = MpdpKdc(2)
    key = keys_.public_bytes(keys_.new_private_key())
    payload = Payload(
        meta={"kind": "x25519-public-key"},
        tensors={"public_key": np.frombuffer(key, dtype=np.uint8).copy()},
    )
    # Execute / Assert
    kdc.accept(Identity("client", 0), payload)
    with pytest.raises(NotReady, match="1 of 2"):
        kdc.issue_keys(1, Identity("client", 0))
    kdc.accept(Identity("client", 1), payload)
    assert kdc.issue_keys(1, Identity("client", 1)).tensors["public_keys"].shape == (2, 32)
    for party in (Identity("server"), Identity("client", 2)):
        with pytest.raises(PermissionError):
            kdc.issue_keys(1, party)
        with pytest.raises(PermissionError):
            kdc.accept(party, payload)
    bad = Payload(
        meta={"kind": "x25519-public-key"}, tensors={"public_key": np.zeros(32, np.uint8)}
    )
    with pytest.raises(MessageRejected):
        kdc.accept(Identity("client", 0), bad)
    restored = MpdpKdc(7)
    restored.load_state_dict(kdc.state_dict())
    assert restored.state_dict() == kdc.state_dict()


def test_noise_multiplier_is_sigma_sqrt_quorum_over_clip_and_none_without_noise() -> None:
    # Prepare
    protocol = Mpdp()
    # Execute / Assert
    assert protocol.noise_multiplier(spec_for(noise=0.0)) is None
    assert protocol.noise_multiplier(spec_for(noise=2.0, clip=0.5, clients=9)) == pytest.approx(
        2.0 * 3 / 0.5
    )
    assert protocol.noise_multiplier(
        spec_for(noise=1.0, clients=10, quorum="'40%'")
    ) == pytest.approx(math.sqrt(4))


def test_noisy_round_adds_noise_of_the_announced_scale_around_the_clipped_mean() -> None:
    # Prepare: Hardened noise is N(0, sigma^2) before recovery, so R o eta_bar has std in
    # [sigma/sqrt(K), 2 sigma/sqrt(K)] given R (R in [1, 2] for one hidden layer).
    sigma = 0.05
    fed = Federation.of(spec_for(mode="Hardened", noise=sigma, clip=1e6, clients=4))
    before = {n: w.copy() for n, w in fed.server.global_weights().items()}
    expected = fed.fedsgd_step(before, [0, 1, 2, 3])
    # Execute
    fed.server.combine(1, fed.uploads(1, fed.server.plan_round(1, [0, 1, 2, 3])), [])
    # Assert
    rate = fed.spec.training.optimizer.learning_rate
    noise = np.concatenate(
        [(expected[n] - fed.server.global_weights()[n]).ravel() / rate for n in before]
    )
    assert sigma / 2 <= noise.std() <= sigma
    assert abs(noise.mean()) < 4 * noise.std() / math.sqrt(noise.size)


def test_state_dict_round_trip_and_kind_check() -> None:
    # Prepare
    fed = Federation.of(spec_for(clients=2))
    other = Federation.of(spec_for(clients=2)).server
    fed.server.combine(1, fed.uploads(1, fed.server.plan_round(1, [0, 1])), [])
    # Execute
    other.load_state_dict(fed.server.state_dict())
    # Assert
    for name, weights in fed.server.global_weights().items():
        np.testing.assert_array_equal(other.global_weights()[name], weights)
    with pytest.raises(ValueError, match="kind"):
        other.load_state_dict({"kind": "fedsgd", "weights": {}})


def test_model_without_hidden_layer_is_refused() -> None:
    # Prepare
    spec = spec_for()
    # Execute / Assert
    with pytest.raises(ProtocolError, match="hidden layer"):
        MpdpServer({"w": np.zeros((3, 4))}, options=spec.protocol.mpdp, learning_rate=0.1)


@pytest.mark.parametrize("mode", ["Faithful", "Hardened"])
def test_a_client_recovers_a_predictor_as_good_as_the_global_model_from_its_own_data(
    mode: str,
) -> None:
    # Prepare: G7 (a known weakness, documented): the perturbed model is the true network up
    # to per-neuron positive scales plus the output shift alpha * r, and least squares on the
    # client's own labelled shard estimates r (n_L numbers).
    trained = simulate(run_for(protocol="fedsgd", hidden="[32]", rounds=20, rate=4.0)).weights
    spec = spec_for(mode=mode, hidden="[32]", output=1.0)
    server = MpdpServer(trained, options=spec.protocol.mpdp, learning_rate=0.5)
    instruction = server.plan_round(1, [0])[0]
    odd = [instruction.tensors["w.0"], instruction.tensors["w.1"]]
    shard, test = client_dataset(spec, 0), test_dataset(spec)

    def perturbed(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        h = np.maximum(x.reshape(len(x), -1) @ odd[0].T, 0) * instruction.tensors["t.0"]
        return h.sum(axis=1), h @ odd[1].T

    # Execute
    alpha, outputs = perturbed(shard.x.astype(np.float64))
    targets = np.eye(outputs.shape[1])[shard.y]
    estimate = (alpha[:, None] * (outputs - targets)).sum(axis=0) / (alpha @ alpha)
    alpha_test, outputs_test = perturbed(test.x.astype(np.float64))
    stolen = outputs_test - alpha_test[:, None] * estimate
    hidden = np.maximum(test.x.reshape(len(test.x), -1) @ trained["1.weight"].T, 0)
    true = hidden @ trained["3.weight"].T
    # Assert
    true_accuracy = float((true.argmax(axis=1) == test.y).mean())
    raw_accuracy = float((outputs_test.argmax(axis=1) == test.y).mean())
    assert true_accuracy > 0.5
    assert raw_accuracy < true_accuracy - 0.1  # the output shift does hide the raw outputs
    assert float((stolen.argmax(axis=1) == test.y).mean()) >= true_accuracy - 0.02


def test_example_manifest_is_a_hardened_nout_mpdp_run_with_a_budget() -> None:
    # Prepare
    example = Path(__file__).resolve().parents[2] / "examples" / "digits-mpdp.yaml"
    # Execute
    run = load_manifest(example)
    # Assert
    spec = run.spec
    assert spec.protocol.name == "mpdp" and spec.clients.count == 10
    assert (spec.protocol.mpdp.mode, spec.protocol.mpdp.graph) == ("Hardened", "NOut")
    assert spec.model.dtype == "float64" and spec.model.bias is False
    assert spec.training.loss == "MSE"
    assert spec.privacy is not None and spec.privacy.target_epsilon is not None
    assert Mpdp().noise_multiplier(spec) is not None


def test_budget_stops_an_mpdp_run_at_the_libraries_epsilon() -> None:
    # Prepare: sigma_eta 2, B 1, a quorum of all 4 clients: z = 2 sqrt(4) / 1 = 4, q = 1, so
    # each round is one Gaussian mechanism; the target lies between the epsilon of 2 and 3.
    def direct(rounds: int) -> float:
        accountant = rdp.RdpAccountant()
        accountant.compose(dp_accounting.GaussianDpEvent(4.0), rounds)
        return float(accountant.get_epsilon(1e-5))

    target = (direct(2) + direct(3)) / 2
    text = MANIFEST % {
        "protocol": "mpdp", "mode": "Hardened", "graph": "NOut", "noise": 2.0, "clip": 1.0,
        "hidden": "[12]", "clients": 4, "quorum": "'100%'", "rounds": 5, "rate": 0.5,
        "output": 0.01,
    }  # fmt: skip
    text += f"  privacy: {{targetEpsilon: {target}, targetDelta: 1.0e-5, accountant: RDP}}\n"
    run = load_manifest("unit-mpdp", text=text)
    # Execute
    result = simulate(run)
    # Assert
    assert Mpdp().noise_multiplier(run.spec) == pytest.approx(4.0, rel=0, abs=1e-12)
    assert result.reason == "BudgetExhausted"
    assert result.rounds_completed == 2
    assert result.epsilon == pytest.approx(direct(2), rel=0, abs=1e-9)
    assert [entry["epsilon"] for entry in result.history] == pytest.approx(
        [direct(1), direct(2)], rel=0, abs=1e-9
    )
