"""UploadStore (fedcore/protocols/_spill.py) and the robust rules run block by block over it.

The store keeps a round's uploads in memory up to a budget and beyond it in private .npy
files; a rule reads the uploads a block of coordinates at a time. The tests check that a rule
gives the same result, bit for bit, over vectors in memory and over a store whose uploads
were all spilled; that a server which takes uploads as they arrive (the server role) ends
where one given whole uploads (the simulation) does; and that combine's memory stays bounded.
"""

from __future__ import annotations

import gc
import stat
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedcore.errors import ProtocolError
from fedcore.learning.training import LocalStats
from fedcore.protocols._maths import flatten
from fedcore.protocols._spill import UploadStore, remove_spilled
from fedcore.protocols.fedavg import aggregators
from fedcore.protocols.fedavg.robust import RobustAveragingServer
from fedcore.spec._options import FedAvgOptions
from fedcore.transport import Payload

# ------------------------------------------------------------------------------ helpers


def _model(rng: np.random.Generator, dtype: type) -> dict[str, np.ndarray]:
    """Tensors spanning several blocks (a block is at most 32768 coordinates), with blocks
    that straddle tensors, a narrower float tensor, and non-float buffers between floats."""
    return {
        "conv.w": rng.standard_normal((3, 11000)).astype(dtype),
        "bn.count": rng.integers(0, 1000, size=(2,)).astype(np.int64),
        "fc.w": rng.standard_normal(40000).astype(dtype),
        "half": rng.standard_normal(9).astype(np.float16),
        "mask": rng.integers(0, 2, size=(17,)).astype(np.uint8),
        "fc.b": rng.standard_normal(5).astype(dtype),
    }


def _uploads(seed: int, dtype: type, count: int) -> dict[int, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {k: _model(rng, dtype) for k in range(count)}


def _stored(
    uploads: dict[int, dict[str, np.ndarray]], budget: int, folder: Path | None
) -> UploadStore:
    store = UploadStore(next(iter(uploads.values())), budget_bytes=budget, spill_dir=folder)
    for k in [*sorted(uploads)[1::2], *sorted(uploads)[::2]]:  # not in client order
        store.add(k, uploads[k])
    return store


# ---------------------------------------------------------------- the old in-memory rules
# The rules as aggregators.py computed them before they ran block by block: Median and
# TrimmedMean must still equal these bit for bit; Krum's and FLTrust's sums over coordinates
# (and the weighted mean) now go block by block, so they equal these up to rounding.


def _old_stack(updates: list[np.ndarray]) -> np.ndarray:
    return np.stack([np.asarray(u, dtype=np.float64).reshape(-1) for u in updates])


def _old_median(updates: list[np.ndarray]) -> np.ndarray:
    return np.median(_old_stack(updates), axis=0)


def _old_trimmed_mean(updates: list[np.ndarray], trim: float) -> np.ndarray:
    stacked = _old_stack(updates)
    n = stacked.shape[0]
    k = int(np.floor(trim * n))
    return np.sort(stacked, axis=0)[k : n - k].mean(axis=0)


def _old_krum_scores(updates: list[np.ndarray], byzantine: int) -> np.ndarray:
    stacked = _old_stack(updates)
    squares = (stacked * stacked).sum(axis=1)
    distances = np.maximum(squares[:, None] + squares[None, :] - 2 * stacked @ stacked.T, 0.0)
    np.fill_diagonal(distances, np.inf)
    return np.sort(distances, axis=1)[:, : len(updates) - byzantine - 2].sum(axis=1)


def _old_fltrust(updates: list[np.ndarray], g0: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    stacked = _old_stack(updates)
    norms = np.linalg.norm(stacked, axis=1)
    products = norms * np.linalg.norm(g0)
    cosines = np.divide(stacked @ g0, products, out=np.zeros(len(stacked)), where=products > 0)
    scores = np.maximum(cosines, 0.0)
    scaled = np.divide(
        stacked * np.linalg.norm(g0),
        norms[:, None],
        out=np.zeros_like(stacked),
        where=norms[:, None] > 0,
    )
    return (scores / scores.sum()) @ scaled, scores


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit for bit (signed zeros included)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


# --------------------------------------------------------------------------- the store


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_in_memory_and_spilled_stores_give_the_same_blocks(tmp_path: Path, dtype: type) -> None:
    # Prepare: the same uploads all in memory, all on disk, and half and half
    uploads = _uploads(1, dtype, 5)
    flats = {k: flatten(u, list(u)) for k, u in uploads.items()}
    length = next(iter(flats.values())).size
    held = _stored(uploads, 2**40, None)
    spilled = _stored(uploads, 0, tmp_path)
    mixed = _stored(uploads, int(2.5 * held.upload_bytes), tmp_path)
    rng = np.random.default_rng(7)
    ranges = [(0, length), (0, 1), (length - 1, length), (32760, 33020), (33000, 73020)]
    ranges += [tuple(sorted(rng.integers(0, length + 1, size=2))) for _ in range(20)]
    # Assert: every range of every subset reads as the flattened uploads' slices
    assert held.spilled_count == 0 and spilled.spilled_count == 5 and mixed.spilled_count == 3
    assert spilled.held_bytes == 0 and mixed.peak_held_bytes == 2 * held.upload_bytes
    assert held.dtype == dtype and held.clients == [0, 1, 2, 3, 4]
    for start, stop in ranges:
        for clients in ([0, 1, 2, 3, 4], [3, 0], [4]):
            expected = np.stack([flats[k][start:stop] for k in clients])
            for store in (held, spilled, mixed):
                assert _same(store.rows(start, stop, clients), expected), (store, start, stop)
    for store in (held, spilled, mixed):
        store.close()


def test_a_store_refuses_a_second_upload_or_another_layout(tmp_path: Path) -> None:
    uploads = _uploads(2, np.float32, 2)
    with UploadStore(uploads[0], budget_bytes=0, spill_dir=tmp_path) as store:
        store.add(0, uploads[0])
        with pytest.raises(ProtocolError, match="already kept"):
            store.add(0, uploads[1])
        with pytest.raises(ProtocolError, match=r"fc\.w"):
            store.add(1, {**uploads[1], "fc.w": uploads[1]["fc.w"].astype(np.float64)})
        with pytest.raises(ProtocolError, match="tensors"):
            store.add(1, {"fc.w": uploads[1]["fc.w"]})
        with pytest.raises(ProtocolError, match="not kept"):
            store.rows(0, 5, [1])


def test_spilled_uploads_are_private_and_removed_on_close(tmp_path: Path) -> None:
    # Prepare
    uploads = _uploads(3, np.float32, 3)
    store = _stored(uploads, 0, tmp_path)
    folder = store.folder
    # Assert: one private folder in the parent asked for, one float and one buffer file each
    assert folder is not None and folder.parent == tmp_path
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    files = sorted(p.name for p in folder.iterdir())
    assert files == [f"client-{k}{part}.npy" for k in range(3) for part in ("", ".other")]
    assert all(stat.S_IMODE((folder / name).stat().st_mode) == 0o600 for name in files)
    store.rows(0, store.length, [0, 1, 2])  # maps the files
    # Execute / Assert: close removes them; so does the context manager; so does collection
    store.close()
    assert not folder.exists() and not any(tmp_path.iterdir())
    with _stored(uploads, 0, tmp_path) as store:
        assert store.folder is not None
    assert not any(tmp_path.iterdir())
    store = _stored(uploads, 0, tmp_path)
    store.rows(0, 10, [2])
    del store
    gc.collect()
    assert not any(tmp_path.iterdir())


UNPICKLED: list[str] = []


def _unpickle() -> str:
    UNPICKLED.append("ran")
    return "ran"


class _Payload:
    """An object whose unpickling runs code: what allow_pickle=False must refuse."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpickle, ())


def test_a_hand_written_object_or_wrong_file_is_refused(tmp_path: Path) -> None:
    # Prepare: two spilled uploads; one file replaced by a pickled object array, one by
    # floats of the wrong dtype
    uploads = _uploads(4, np.float32, 2)
    store = _stored(uploads, 0, tmp_path)
    assert store.folder is not None
    np.save(store.folder / "client-0.npy", np.array([_Payload()], dtype=object), allow_pickle=True)
    np.save(store.folder / "client-1.npy", np.zeros(store.length - 19, dtype=np.float64))
    # Execute / Assert
    with pytest.raises(ProtocolError, match="spilled upload cannot be read"):
        store.rows(0, 10, [0])
    with pytest.raises(ProtocolError, match="is not the float32"):
        store.rows(0, 10, [1])
    assert UNPICKLED == []
    store.close()


# ----------------------------------------------------------------- the rules over a store


def _updates(
    seed: int, dtype: type, count: int, tmp_path: Path
) -> tuple[list[np.ndarray], aggregators.Rows, UploadStore]:
    """Uploads around a model theta, as updates flatten(upload) - theta in memory and as rows
    of a store whose uploads all went to disk. Client 1 uploads theta itself (a zero update)."""
    rng = np.random.default_rng(seed)
    base = _model(rng, dtype)
    uploads = {
        k: {
            n: (v + rng.standard_normal(v.shape) * rng.uniform(0.5, 2)).astype(v.dtype)
            if v.dtype.kind == "f"
            else v + rng.integers(0, 3, size=v.shape).astype(v.dtype)
            for n, v in base.items()
        }
        for k in range(count)
    }
    uploads[1] = base
    theta = flatten(base, list(base))
    store = _stored(uploads, 0, tmp_path)
    assert store.spilled_count == count
    clients = sorted(uploads)
    vectors = [flatten(uploads[k], list(uploads[k])) - theta for k in clients]
    assert not vectors[1].any()
    return vectors, store.view(clients, minus=theta), store


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", [0, 1])
def test_coordinate_wise_rules_over_a_spilled_store_equal_the_in_memory_ones(
    tmp_path: Path, dtype: type, seed: int
) -> None:
    vectors, rows, store = _updates(seed, dtype, 7, tmp_path)
    with store:
        median = aggregators.median(rows)
        assert _same(median, aggregators.median(vectors))
        assert _same(median, _old_median(vectors))
        for trim in (0.0, 0.2, 0.45):
            trimmed = aggregators.trimmed_mean(rows, trim)
            assert _same(trimmed, aggregators.trimmed_mean(vectors, trim))
            assert _same(trimmed, _old_trimmed_mean(vectors, trim))
        assert _same(aggregators.mean(rows), aggregators.mean(vectors))
        assert _same(aggregators.mean(rows), _old_stack(vectors).mean(axis=0))
        weights = [3.0, 1.0, 2.0, 7.0, 1.0, 1.0, 5.0]
        weighted = aggregators.mean(rows, weights)
        assert _same(weighted, aggregators.mean(vectors, weights))
        np.testing.assert_allclose(
            weighted,
            (np.array(weights) / sum(weights)) @ _old_stack(vectors),
            rtol=1e-12,
            atol=1e-14,
        )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("byzantine", [0, 1, 3])
def test_krum_over_a_spilled_store_equals_the_in_memory_one(
    tmp_path: Path, dtype: type, byzantine: int
) -> None:
    vectors, rows, store = _updates(byzantine, dtype, 7, tmp_path)
    with store:
        scores = aggregators.krum_scores(rows, byzantine)
        chosen, update = aggregators.krum(rows, byzantine)
        assert _same(scores, aggregators.krum_scores(vectors, byzantine))
        expected_chosen, expected = aggregators.krum(vectors, byzantine)
        assert chosen == expected_chosen and _same(update, expected)
        assert _same(update, vectors[chosen])
        # the old Gram-matrix sums: the same choice, the same scores up to rounding
        old = _old_krum_scores(vectors, byzantine)
        np.testing.assert_allclose(scores, old, rtol=1e-9)
        assert chosen == int(np.argmin(old))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fltrust_over_a_spilled_store_equals_the_in_memory_one(
    tmp_path: Path, dtype: type, seed: int
) -> None:
    vectors, rows, store = _updates(seed, dtype, 6, tmp_path)
    # the server's update: near some clients' (positive scores), away from others' (zero)
    g0 = vectors[0] + vectors[2] - vectors[3]
    with store:
        found, scores = aggregators.fltrust_scored(rows, g0)
        expected, expected_scores = aggregators.fltrust_scored(vectors, g0)
        assert _same(found, expected) and _same(scores, expected_scores)
        assert _same(found, aggregators.fltrust(rows, g0))
        assert _same(scores, aggregators.trust_scores(rows, g0))
        assert scores[1] == 0.0 and scores[0] > 0 and scores[3] == 0.0
        old, old_scores = _old_fltrust(vectors, g0)
        np.testing.assert_allclose(scores, old_scores, rtol=1e-10, atol=1e-15)
        np.testing.assert_allclose(found, old, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------- the server taking uploads


class _Root:
    """FLTrust's root learner: a fixed step from the model it is given."""

    def train(self, weights: dict[str, np.ndarray], *, round: int) -> tuple[Any, LocalStats]:
        return {n: (v + 0.01 * (round + 1)).astype(v.dtype) for n, v in weights.items()}, (
            LocalStats(5, 0.1, 1)
        )


def _server(rule: str, clusters: int = 1, **more: Any) -> RobustAveragingServer:
    initial = {
        "w": np.random.default_rng(0).standard_normal((200, 180)).astype(np.float32),
        "count": np.array(3, dtype=np.int64),
        "b": np.zeros(180, dtype=np.float32),
    }
    options = FedAvgOptions(aggregator=rule, clusters=clusters, krum_byzantine=1, **more)
    root = _Root() if rule == "FLTrust" else None
    return RobustAveragingServer(initial, options=options, root=root, seed=4)  # type: ignore[arg-type]


def _round_uploads(
    server: RobustAveragingServer, clients: list[int], seed: int
) -> dict[int, Payload]:
    rng = np.random.default_rng(seed)
    models = server.models()
    uploads = {}
    for k in clients:
        cluster = k % len(models)
        tensors = {
            n: (v + 0.01 * rng.standard_normal(v.shape)).astype(v.dtype)
            if v.dtype.kind == "f"
            else np.asarray(v + int(rng.integers(0, 3)), dtype=v.dtype)
            for n, v in models[cluster].items()
        }
        meta: dict[str, Any] = {"num_examples": int(rng.integers(1, 40)), "loss": float(k)}
        if len(models) > 1:
            meta["cluster"] = cluster
        uploads[k] = Payload(meta=meta, tensors=tensors)
    return uploads


def _take(
    server: RobustAveragingServer, round: int, uploads: dict[int, Payload]
) -> dict[int, Payload]:
    """What the server role does: check and take each upload as it arrives (here: in an
    order other than the clients'), keeping the stand-ins."""
    kept = {}
    for k in sorted(uploads, key=lambda k: (k * 5) % 7):
        server.check_upload(round, k, uploads[k])
        stand_in = server.take_upload(round, k, uploads[k])
        assert stand_in is not None and not stand_in.tensors and stand_in.meta == uploads[k].meta
        kept[k] = stand_in
    return kept


def _assert_same_models(a: RobustAveragingServer, b: RobustAveragingServer) -> None:
    for model, expected in zip(a.models(), b.models(), strict=True):
        for name, value in expected.items():
            assert _same(model[name], value), name


@pytest.mark.parametrize(
    ("rule", "clusters"),
    [
        ("Median", 1),
        ("TrimmedMean", 1),
        ("Krum", 1),
        ("FLTrust", 1),
        ("Median", 2),
        ("Mean", 2),
        ("Krum", 2),
    ],
)
def test_a_server_taking_uploads_ends_where_one_given_whole_uploads_does(
    tmp_path: Path, rule: str, clusters: int
) -> None:
    # Prepare: the same server twice; the streaming one keeps every upload on disk
    streaming, batch = _server(rule, clusters), _server(rule, clusters)
    streaming.keep_uploads_on_disk(tmp_path)  # spec.uploads.storage Disk: no budget
    clients = [0, 1, 2, 3, 4, 5, 6, 7, 8]
    for round in (1, 2):
        uploads = _round_uploads(batch, clients, seed=round)
        for server in (streaming, batch):
            server.plan_round(round, [*clients, 9])
        # Execute: round 1 is redone; its first attempt takes uploads that the redo drops
        if round == 1:
            _take(streaming, round, _round_uploads(batch, [0, 3, 5], seed=99))
            assert any(tmp_path.iterdir())
            streaming.plan_round(round, [*clients, 9])
            assert not any(tmp_path.iterdir()), "a redo drops the first attempt's uploads"
        kept = _take(streaming, round, uploads)
        result = streaming.combine(round, kept, [9])
        expected = batch.combine(round, uploads, [9])  # the simulation's path
        # Assert
        assert result == expected
        _assert_same_models(streaming, batch)
        assert not any(tmp_path.iterdir()), "combine removes the spilled uploads"
    assert not _same(streaming.models()[0]["w"], _server(rule, clusters).models()[0]["w"])


def test_a_server_without_a_plan_keeps_uploads_whole_and_combines_them() -> None:
    server, batch = _server("Median"), _server("Median")
    uploads = _round_uploads(server, [0, 1, 2], seed=3)
    assert server.take_upload(1, 0, uploads[0]) is None
    server.combine(1, uploads, [])
    batch.plan_round(1, [0, 1, 2])
    batch.combine(1, uploads, [])
    _assert_same_models(server, batch)
    with pytest.raises(ProtocolError, match="tensors"):
        server.combine(2, {0: Payload(meta=uploads[0].meta)}, [])


# ----------------------------------------------------------------------------- memory

CLIENTS = 16
ELEMENTS = 1_000_000  # float32: 4 MB an upload, 64 MB for the round


@pytest.mark.parametrize("rule", ["Median", "TrimmedMean", "Krum"])
def test_a_round_of_spilled_uploads_holds_a_few_models_and_k_blocks(
    tmp_path: Path, rule: str
) -> None:
    # Prepare: uploads made, taken and dropped one at a time, as the server role does
    initial = {"w": np.zeros(ELEMENTS, dtype=np.float32)}
    options = FedAvgOptions(aggregator=rule, krum_byzantine=2)
    server = RobustAveragingServer(initial, options=options)
    server.hold_bytes, server.spill_dir = 0, str(tmp_path)
    rng = np.random.default_rng(0)
    model_bytes = initial["w"].nbytes
    block = aggregators.block_width(CLIENTS)
    # The bound: four model sizes (the float64 step counts two; one upload being made and
    # checked, the check's copy of the model) and two K x block float64 arrays (the block
    # read, a rule's working copy of it): 24.4 MB, where the round's uploads are 64 MB.
    bound = 4 * model_bytes + 2 * CLIENTS * block * 8
    assert bound < CLIENTS * model_bytes, "holding the round's uploads would pass the bound"
    # Execute
    tracemalloc.start()
    try:
        server.plan_round(1, list(range(CLIENTS)))
        kept = {}
        for k in range(CLIENTS):
            upload = Payload(
                meta={"num_examples": 10, "loss": 0.5},
                tensors={"w": rng.standard_normal(ELEMENTS, dtype=np.float32) * 1e-3},
            )
            server.check_upload(1, k, upload)
            kept[k] = server.take_upload(1, k, upload)
            del upload
        assert len(list(next(tmp_path.iterdir()).iterdir())) == CLIENTS
        result = server.combine(1, kept, [])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Assert
    assert result is not None and result.participants == CLIENTS
    assert peak < bound, f"peak {peak / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB"
    assert np.any(server.global_weights()["w"] != 0)


def test_a_servers_start_removes_the_spill_folders_a_dead_server_left(tmp_path: Path) -> None:
    # Prepare: a fold's and a store's folders with a file each (as a killed server leaves
    # them), beside a run folder's own files and a folder that only looks alike
    left = [tmp_path / "fedcore-fold-abc", tmp_path / "fedcore-store-xyz"]
    for folder in left:
        folder.mkdir()
        (folder / "client-0.bin").write_bytes(b"an upload")
    kept = [tmp_path / "checkpoints", tmp_path / "model.safetensors", tmp_path / "fold-notes"]
    kept[0].mkdir()
    kept[1].write_bytes(b"model")
    kept[2].mkdir()
    # Execute
    removed = remove_spilled(tmp_path)
    # Assert
    assert removed == 2
    assert not any(folder.exists() for folder in left)
    assert all(path.exists() for path in kept)
    assert remove_spilled(tmp_path / "missing") == 0
