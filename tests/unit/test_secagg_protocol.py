"""secagg's five stages, driven in memory: exact sums whoever drops out, and the refusals an
honest client owes a lying server."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from fedcore.errors import ProtocolError
from fedcore.learning.training import LocalStats
from fedcore.protocols.secagg import maths as sm
from fedcore.protocols.secagg.protocol import MASKED, SecAggClient, SecAggServer
from fedcore.rounds import AttemptReport, play_stages
from fedcore.spec._options.secagg import SecAggOptions
from fedcore.transport import Payload, issue_run_bundles

CLIENTS = 10
ROUND = 1


class FixedLearner:
    """Stands in for local training (pure protocol logic): returns a fixed model."""

    def __init__(self, trained: dict[str, np.ndarray]) -> None:
        self.trained = trained

    def train(self, weights: dict[str, np.ndarray], *, round: int) -> tuple[dict, LocalStats]:
        return self.trained, LocalStats(10, 0.5, 1)


@pytest.fixture(scope="module")
def bundles():
    return issue_run_bundles("secagg-test", num_clients=CLIENTS)[1]


def _setup(bundles, options: SecAggOptions | None = None, seed: int = 0):
    options = options or SecAggOptions(dropout_rate=0.2, corrupt_rate=0.1)
    rng = np.random.default_rng(seed)
    initial = {
        "w": rng.standard_normal((6, 5)).astype(np.float32),
        "b": rng.standard_normal(5).astype(np.float32),
        "steps": np.array([3], dtype=np.int64),  # not summed: keeps the global value
    }
    server = SecAggServer(initial, options)
    clients = {}
    learners = {}
    for k in range(CLIENTS):
        clients[k] = SecAggClient(k, options, seed=0)
        clients[k].set_identity(bundles[f"client-{k}"])
        trained = {
            "w": (initial["w"] + rng.normal(0, 0.3, (6, 5))).astype(np.float32),
            "b": (initial["b"] + rng.normal(0, 0.3, 5)).astype(np.float32),
            "steps": np.array([99], dtype=np.int64),
        }
        learners[k] = FixedLearner(trained)
    return initial, server, clients, learners


def _run(server, clients, learners, drops: Mapping[int, set[int]]) -> AttemptReport:
    """One attempt over every client, ``drops[stage]`` failing to answer that stage."""
    gone: set[int] = set()

    def run_stage(round_: int, attempt: int, stage: int, plans: Mapping[int, Payload]):
        gone.update(drops.get(stage, set()))
        responses, failed = {}, {}
        for k, instruction in plans.items():
            if k in gone:
                failed[k] = "disconnected"
                continue
            if stage == 0:
                response = clients[k].compute_upload(round_, instruction, learners[k], None)
            else:
                response = clients[k].respond(round_, stage, instruction)
            server.check_upload(round_, k, response)
            responses[k] = response
        return AttemptReport(responses, failed)

    plans = server.plan_round(ROUND, list(range(CLIENTS)))
    return play_stages(server, ROUND, 1, plans, run_stage)


def _expected_mean(clients, survivors: list[int], options: SecAggOptions) -> np.ndarray:
    """The mean of the survivors' quantized updates, summed in plain integers."""
    total = sum(0 + clients[k]._attempt.words.astype(object) for k in survivors)
    levels = 2**options.quantization_bits
    q = sm.Quantization(options.clip_range, levels, sm.choose_bits(len(survivors), levels))
    exact = sm.dequantize_sum(np.array(total, dtype=np.uint64), len(survivors), q)
    return exact / len(survivors)


@pytest.mark.parametrize(
    ("stage", "dropped"),
    [
        (None, set()),
        (0, {2}),  # never advertises
        (1, {2, 7}),  # advertised, never opens its commitment
        (2, {2, 7}),  # revealed its nonce, never shares
        (3, {2, 7}),  # shared, never sends its masked input: its mask key is rebuilt
        (4, {4}),  # its masked input is summed, it does not sign the survivor list
        (5, {4, 5}),  # summed and signed, does not reveal: the others' shares suffice
    ],
)
def test_the_sum_is_exact_whatever_stage_clients_drop_out_at(bundles, stage, dropped) -> None:
    options = SecAggOptions(dropout_rate=0.2, corrupt_rate=0.1)
    initial, server, clients, learners = _setup(bundles, options)
    report = _run(server, clients, learners, {} if stage is None else {stage: dropped})
    summed = [k for k in range(CLIENTS) if stage is None or stage >= 4 or k not in dropped]
    attempt = server._attempt
    assert attempt.survivors == summed
    mean = _expected_mean(clients, summed, options)
    assert np.array_equal(attempt.total / len(summed), mean)
    result = server.combine(ROUND, report.uploads, report.failures)
    assert result.participants == len(summed)
    flat = np.concatenate([initial["w"].astype(np.float64).ravel(), initial["b"].ravel()])
    got = server.global_weights()
    expected = (flat + mean).astype(np.float32)
    assert np.array_equal(got["w"].ravel(), expected[:30])
    assert np.array_equal(got["b"], expected[30:])
    assert np.array_equal(got["steps"], initial["steps"])
    # Quantization's error is bounded by one level per coordinate of the clipped update.
    updates = np.stack(
        [
            np.concatenate(
                [
                    (learners[k].trained[n].astype(np.float64) - initial[n]).ravel()
                    for n in ("w", "b")
                ]
            )
            for k in summed
        ]
    )
    step = 2 * options.clip_range / (2**options.quantization_bits - 1)
    assert np.max(np.abs(updates.mean(axis=0) - mean)) <= step


def test_too_few_survivors_fail_the_attempt_and_reveal_nothing(bundles) -> None:
    options = SecAggOptions(dropout_rate=0.2, corrupt_rate=0.1)
    _, server, clients, learners = _setup(bundles, options)
    report = _run(server, clients, learners, {3: set(range(1, CLIENTS))})
    assert report.uploads == {}
    assert "stage 3 failed" in report.failed[0] and "threshold" in report.failed[0]
    assert server._attempt.total is None
    assert all(not c._attempt.revealed for c in clients.values())


def test_the_masked_inputs_look_nothing_like_the_inputs(bundles) -> None:
    """What the server receives of a client: words spread over the whole modulus, whatever
    the update (here every client's update is zero, so its inputs are one of two levels)."""
    options = SecAggOptions(dropout_rate=0.2, corrupt_rate=0.1)
    initial, server, clients, learners = _setup(bundles, options)
    for learner in learners.values():
        learner.trained = {name: value.copy() for name, value in initial.items()}
    captured: dict[int, np.ndarray] = {}
    original = server.check_upload

    def capture(round_: int, client: int, upload: Payload) -> None:
        original(round_, client, upload)
        if MASKED in upload.tensors:
            captured[client] = upload.tensors[MASKED]

    server.check_upload = capture  # type: ignore[method-assign]
    _run(server, clients, learners, {})
    bits = server._attempt.encoding.bits
    for k, masked in captured.items():
        plain = clients[k]._attempt.words
        assert int(plain.max()) - int(plain.min()) <= 1  # zero lies between two levels
        assert np.mean(masked == plain) < 0.1
        # Uniform over 2^bits: the top bit is set about half the time.
        assert 0.2 < np.mean(masked >> np.uint64(bits - 1)) < 0.8
    assert len(captured) == CLIENTS


def _advance_to(stage: int, bundles):
    """Runs an attempt up to (and including) the responses of ``stage``; returns what the
    server would send next."""
    options = SecAggOptions(dropout_rate=0.2, corrupt_rate=0.1)
    _, server, clients, learners = _setup(bundles, options)
    plans = server.plan_round(ROUND, list(range(CLIENTS)))
    for current in range(stage + 1):
        responses = {}
        for k, instruction in plans.items():
            if current == 0:
                responses[k] = clients[k].compute_upload(ROUND, instruction, learners[k], None)
            else:
                responses[k] = clients[k].respond(ROUND, current, instruction)
            server.check_upload(ROUND, k, responses[k])
        plans = server.next_stage(ROUND, current, responses, [])
    return server, clients, plans


def test_a_client_refuses_to_unmask_another_list_than_it_signed(bundles) -> None:
    _server, clients, plans = _advance_to(4, bundles)
    instruction = plans[0]
    lie = dict(instruction.meta)
    lie["survivors"] = [k for k in instruction.meta["survivors"] if k != 1]
    with pytest.raises(ProtocolError, match="another survivor list than the one this client"):
        clients[0].respond(ROUND, 5, Payload(meta=lie))


def test_a_client_reveals_once(bundles) -> None:
    _server, clients, plans = _advance_to(4, bundles)
    clients[0].respond(ROUND, 5, plans[0])
    with pytest.raises(ProtocolError):
        clients[0].respond(ROUND, 5, plans[0])


def test_a_client_signs_one_survivor_list_only(bundles) -> None:
    _server, clients, plans = _advance_to(3, bundles)
    clients[0].respond(ROUND, 4, plans[0])
    other = dict(plans[0].meta)
    other["survivors"] = [k for k in plans[0].meta["survivors"] if k != 1]
    clients[0]._attempt.stage = 3  # a server replaying stage 4 with another list
    with pytest.raises(ProtocolError, match="second survivor list"):
        clients[0].respond(ROUND, 4, Payload(meta=other))


def test_unmasking_needs_threshold_signatures_of_the_list(bundles) -> None:
    _server, clients, plans = _advance_to(4, bundles)
    meta = dict(plans[0].meta)
    threshold = clients[0]._attempt.threshold
    signatures = dict(meta["signatures"])
    meta["signatures"] = dict(list(signatures.items())[: threshold - 1])
    with pytest.raises(ProtocolError, match="survivors signed this survivor list"):
        clients[0].respond(ROUND, 5, Payload(meta=meta))
    forged = dict(signatures)
    first = next(iter(forged))
    forged = {key: forged[first] for key in forged}  # one client's signature under every name
    meta["signatures"] = forged
    with pytest.raises(ProtocolError, match="survivors signed"):
        clients[0].respond(ROUND, 5, Payload(meta=meta))


def test_a_key_the_client_did_not_sign_is_refused(bundles) -> None:
    _server, clients, plans = _advance_to(0, bundles)
    meta = dict(plans[0].meta)
    keys = {k: dict(v) for k, v in meta["keys"].items()}
    keys["3"]["s"] = keys["4"]["s"]  # the server swaps in another key for client 3
    meta["keys"] = keys
    with pytest.raises(ProtocolError, match="client 3"):
        clients[0].respond(ROUND, 1, Payload(meta=meta))


def test_a_certificate_of_another_client_is_refused(bundles) -> None:
    _server, clients, plans = _advance_to(0, bundles)
    meta = dict(plans[0].meta)
    keys = {k: dict(v) for k, v in meta["keys"].items()}
    keys["3"]["cert"] = keys["4"]["cert"]
    meta["keys"] = keys
    with pytest.raises(ProtocolError, match="client 3"):
        clients[0].respond(ROUND, 1, Payload(meta=meta))


def test_the_server_cannot_leave_a_client_out_of_its_own_round(bundles) -> None:
    _server, clients, plans = _advance_to(0, bundles)
    meta = dict(plans[0].meta)
    meta["advertised"] = [k for k in meta["advertised"] if k != 0]
    meta["keys"] = {k: v for k, v in meta["keys"].items() if k != "0"}
    with pytest.raises(ProtocolError, match="leaves this client out"):
        clients[0].respond(ROUND, 1, Payload(meta=meta))


def test_a_server_cannot_ask_for_stages_out_of_order(bundles) -> None:
    _server, clients, plans = _advance_to(0, bundles)
    with pytest.raises(ProtocolError, match="stage 3 after stage 0"):
        clients[0].respond(ROUND, 3, Payload(meta={"session": plans[0].meta["session"]}))


@pytest.mark.parametrize(
    ("stage", "meta", "message"),
    [
        (0, {"c": "00" * 32, "s": "11" * 32}, "client 0"),
        (0, {"c": "zz"}, "hex"),
        (1, {"nonce": "00" * 32}, "does not open its commitment"),
        (2, {"shares": {"99": "00"}}, "neighbours"),
        (4, {"signature": 5}, "signature"),
        (5, {"self": {"0": "00" * sm.SHARE_BYTES}, "mask": {}}, "may not"),
        (2, {"declined": "no"}, "declined"),
    ],
)
def test_malformed_responses_are_refused_naming_the_client(bundles, stage, meta, message) -> None:
    server, _clients, _plans = _advance_to(stage - 1, bundles) if stage else _advance_to(0, bundles)
    if stage == 0:
        server.plan_round(ROUND, list(range(CLIENTS)))
    with pytest.raises(ProtocolError, match=message):
        server.check_upload(ROUND, 0, Payload(meta=meta))


def test_a_masked_input_past_the_modulus_is_refused(bundles) -> None:
    server, _clients, _plans = _advance_to(2, bundles)
    bits = server._attempt.encoding.bits
    words = np.full(35, 2**bits, dtype=np.uint64)
    with pytest.raises(ProtocolError, match="words of"):
        server.check_upload(ROUND, 0, Payload(tensors={MASKED: words}))
    with pytest.raises(ProtocolError, match="uint64 words"):
        server.check_upload(ROUND, 0, Payload(tensors={MASKED: np.zeros(34, dtype=np.uint64)}))


def test_no_private_key_pair_seed_or_plain_input_reaches_the_server(bundles) -> None:
    """Every byte the server receives in a whole attempt (as the transport encodes it) holds
    none of a client's private keys, none of the pair seeds between survivors, and no 16-byte
    run of any client's plain input words."""
    from fedcore.protocols.secagg import keys as sk
    from fedcore.transport._codec import encode_chunks

    options = SecAggOptions(dropout_rate=0.2, corrupt_rate=0.1)
    _, server, clients, learners = _setup(bundles, options)
    received: list[Payload] = []
    original = server.check_upload

    def capture(round_: int, client: int, upload: Payload) -> None:
        received.append(upload)
        original(round_, client, upload)

    server.check_upload = capture  # type: ignore[method-assign]
    _run(server, clients, learners, {3: {7}})  # one client lost after sharing
    wire = b"".join(
        chunk for upload in received for chunk in encode_chunks(upload, chunk_bytes=1 << 20)
    )
    survivors = server._attempt.survivors
    secrets_: list[bytes] = []
    for k, client in clients.items():
        attempt = client._attempt
        secrets_.append(attempt.keys.c_private.private_bytes_raw())
        if k in survivors:
            secrets_.append(attempt.keys.mask_private_bytes())
            for v in attempt.neighbours:
                if v in survivors:
                    secrets_.append(
                        sk.pair_seed(
                            attempt.keys.s_private,
                            attempt.publics[v][1],
                            run=attempt.session,
                            round=ROUND,
                            pair=(min(k, v), max(k, v)),
                        )
                    )
            plain = attempt.words.tobytes()
            secrets_ += [plain[i : i + 16] for i in range(0, len(plain) - 16, 16)]
    assert len(wire) > 10_000 and len(secrets_) > 100
    for secret in secrets_:
        assert secret[:16] not in wire
        assert secret[-16:] not in wire


def test_a_nonce_that_does_not_open_its_commitment_is_refused(bundles) -> None:
    """The graph comes from nonces each client committed to (and signed) before any was
    revealed: a server (or a client it controls) cannot swap in another one afterwards."""
    _server, clients, plans = _advance_to(1, bundles)
    meta = dict(plans[0].meta)
    nonces = dict(meta["nonces"])
    nonces["3"] = "11" * 32
    meta["nonces"] = nonces
    with pytest.raises(ProtocolError, match="Client 3's nonce does not open its commitment"):
        clients[0].respond(ROUND, 2, Payload(meta=meta))
    honest = clients[1].respond(ROUND, 2, plans[1])
    assert set(honest.meta["shares"])  # the same request, unaltered, is answered


# ------------------------------------------------------------- accountable shares (insiders)


def _attempt(server, clients, learners, number: int, tamper=None) -> AttemptReport:
    """One attempt over the clients the server plans for; ``tamper(stage, client, response)``
    may replace a response (a client lying)."""

    def run_stage(round_: int, attempt: int, stage: int, plans: Mapping[int, Payload]):
        responses = {}
        for k, instruction in plans.items():
            if stage == 0:
                response = clients[k].compute_upload(round_, instruction, learners[k], None)
            else:
                response = clients[k].respond(round_, stage, instruction)
            if tamper is not None:
                response = tamper(stage, k, response)
            server.check_upload(round_, k, response)
            responses[k] = response
        return AttemptReport(responses, {})

    return play_stages(
        server, ROUND, number, server.plan_round(ROUND, list(range(CLIENTS))), run_stage
    )


def _bumped(share_hex: str) -> str:
    """Another field element: the share plus one."""
    value = (int(share_hex, 16) + 1) % sm.FIELD_PRIME
    return value.to_bytes(sm.SHARE_BYTES, "big").hex()


def test_a_client_revealing_a_false_share_is_barred_and_the_round_still_sums_exactly(
    bundles, caplog: pytest.LogCaptureFixture
) -> None:
    """Client 3 reveals a false share of every survivor it holds one of: the dealers'
    signatures show the shares are not the ones they dealt, so client 3 is barred, its shares
    are dropped, and the others' shares rebuild every seed: the round completes exactly."""
    options = SecAggOptions(dropout_rate=0.2, corrupt_rate=0.1)
    initial, server, clients, learners = _setup(bundles, options)

    def lie(stage: int, client: int, response: Payload) -> Payload:
        if stage != 5 or client != 3:
            return response
        meta = dict(response.meta)
        meta["self"] = {owner: _bumped(text) for owner, text in meta["self"].items()}
        return Payload(meta=meta)

    # Execute
    report = _attempt(server, clients, learners, 1, lie)
    # Assert
    assert not report.failed, report.failed
    summed = list(range(CLIENTS))
    assert np.array_equal(server._attempt.total / CLIENTS, _expected_mean(clients, summed, options))
    assert list(server.barred) == [3]
    assert "did not deal" in server.barred[3]
    assert "client 3 is barred from the run" in caplog.text
    result = server.combine(ROUND, report.uploads, report.failures)
    assert result.metrics["barred"] == 1.0
    assert 3 not in server.plan_round(ROUND + 1, list(range(CLIENTS)))
    restored = SecAggServer(initial, options)
    restored.load_state_dict(server.state_dict())
    assert restored.barred == server.barred


def test_a_false_share_among_exactly_t_is_caught_by_its_signature(bundles) -> None:
    """With exactly t shares a false one would pass Lagrange unseen: their signatures are
    checked, the liar is barred, and too few shares remain, so the attempt fails by name."""
    options = SecAggOptions(dropout_rate=0.2, corrupt_rate=0.1)
    _, server, clients, learners = _setup(bundles, options)
    holders: dict[int, list[int]] = {}

    def keep_t_then_lie(stage: int, client: int, response: Payload) -> Payload:
        if stage != 5:
            return response
        meta = {key: dict(value) for key, value in response.meta.items()}
        for owner in list(meta["self"]):  # each owner's first t holders (in index order) reveal
            chosen = holders.setdefault(int(owner), [])
            if len(chosen) < server._attempt.threshold:
                chosen.append(client)
            else:
                del meta["self"][owner], meta["self_signatures"][owner]
        if client == 3:
            meta["self"] = {owner: _bumped(text) for owner, text in meta["self"].items()}
        return Payload(meta=meta)

    report = _attempt(server, clients, learners, 1, keep_t_then_lie)
    assert any(3 in chosen for chosen in holders.values())  # client 3 was among some t
    assert report.uploads == {}
    reasons = set(report.failed.values())
    assert len(reasons) == 1 and "valid shares of client" in reasons.pop()
    assert list(server.barred) == [3]


def test_a_dealer_of_inconsistent_shares_is_barred_and_the_redo_sums_the_others_exactly(
    bundles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Client 2 deals shares of its self-mask seed that lie on no one polynomial, signing
    each: the shares all carry its signature, so it is the liar. The attempt fails naming it,
    and the redo, without it, sums the other nine exactly."""
    options = SecAggOptions(dropout_rate=0.2, corrupt_rate=0.1)
    _, server, clients, learners = _setup(bundles, options)
    split = sm.split_secret

    def dealing_falsely(secret: bytes, threshold: int, holders):
        shares = split(secret, threshold, holders)
        attempt = clients[2]._attempt
        if attempt is not None and secret == attempt.self_seed:
            first = sorted(shares)[0]
            shares[first] = bytes.fromhex(_bumped(shares[first].hex()))
        return shares

    monkeypatch.setattr(sm, "split_secret", dealing_falsely)
    # Execute
    first = _attempt(server, clients, learners, 1)
    monkeypatch.setattr(sm, "split_secret", split)
    second = _attempt(server, clients, learners, 2)
    # Assert
    assert first.uploads == {}
    assert all(
        "Client 2 dealt shares of its self-mask seed" in why for why in first.failed.values()
    )
    assert list(server.barred) == [2] and "each signed by it" in server.barred[2]
    assert not second.failed and 2 not in second.uploads
    others = [k for k in range(CLIENTS) if k != 2]
    expected = _expected_mean(clients, others, options)
    assert np.array_equal(server._attempt.total / len(others), expected)


def test_a_client_shown_another_attempt_than_the_others_refuses_to_unmask(bundles) -> None:
    """The server tells client 0 that client 9 never shared (9 drops before its masked input;
    the others are told it shared). The survivor list is the same for all, but each client
    signs it under its view of the attempt, so client 0 finds fewer than t signatures it can
    verify and reveals nothing, while the others, who share a view, go on."""
    options = SecAggOptions(dropout_rate=0.2, corrupt_rate=0.1)
    _, server, clients, learners = _setup(bundles, options)
    plans = server.plan_round(ROUND, list(range(CLIENTS)))
    answers: dict[int, Payload] = {}
    for stage in range(6):
        responses = {}
        for k, instruction in plans.items():
            if stage == 3 and k == 9:
                continue  # drops before its masked input
            if stage == 3 and k == 0:
                meta = dict(instruction.meta)
                meta["shared"] = [v for v in meta["shared"] if v != 9]
                meta["sealed"] = {v: c for v, c in meta["sealed"].items() if v != "9"}
                instruction = Payload(meta=meta)
            try:
                response = (
                    clients[k].compute_upload(ROUND, instruction, learners[k], None)
                    if stage == 0
                    else clients[k].respond(ROUND, stage, instruction)
                )
            except ProtocolError as exc:
                answers[k] = Payload(meta={"declined": str(exc)})
                continue
            server.check_upload(ROUND, k, response)
            responses[k] = response
            answers[k] = response
        if stage == 5:
            break
        plans = server.next_stage(ROUND, stage, responses, [])
    assert "declined" in answers[0].meta
    assert "the server may be showing clients different lists" in answers[0].meta["declined"]
    assert all("declined" not in answers[k].meta for k in range(1, 9))


def test_a_degree_set_by_the_spec_is_the_graph_every_party_draws(bundles) -> None:
    options = SecAggOptions(dropout_rate=0.2, corrupt_rate=0.1, degree=8)
    _, server, clients, learners = _setup(bundles, options)
    report = _run(server, clients, learners, {})
    assert not report.failed
    assert server._attempt.degree == 8
    assert all(len(clients[k]._attempt.neighbours) == 8 for k in range(CLIENTS))
    assert server._attempt.threshold == options.graph_parameters(CLIENTS)[1]
