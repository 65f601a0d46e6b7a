"""Uploads summed as they arrive (fedcore.protocols._fold): exact, ordered, bounded."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import stat
import tempfile
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcore.errors import ProtocolError
from fedcore.protocols import _fold, _kernels
from fedcore.protocols._bounds import UploadBounds
from fedcore.protocols._fold import OrderedFold, weighted_sum
from fedcore.protocols.dp_fedavg import DpFedAvgServer
from fedcore.protocols.fedavg.protocol import ModelAveragingServer
from fedcore.transport import PackedTensors, Payload, decode_chunks, encode_chunks

SHAPES = {"w": (3, 5), "b": (5,), "big": (2, 40_000)}
"""A tensor larger than one block (2**15 elements), so blocks are exercised too."""
ON_DISK = -1
"""A ``hold`` that means: ``on_disk``, every upload in a file."""


def _uploads(
    rng: np.random.Generator, clients: int, dtype: str
) -> dict[int, dict[str, np.ndarray]]:
    return {
        k: {
            name: (rng.standard_normal(shape) * 10.0 ** rng.integers(-8, 8, size=shape)).astype(
                dtype
            )
            for name, shape in SHAPES.items()
        }
        for k in range(clients)
    }


def _reference(uploads: dict[int, dict[str, np.ndarray]], weights: dict[int, float]) -> dict:
    """An independent sum: whole-tensor float64 terms added in client order."""
    total = {name: np.zeros(shape, dtype=np.float64) for name, shape in SHAPES.items()}
    for k in sorted(uploads):
        for name in SHAPES:
            total[name] = total[name] + uploads[k][name].astype(np.float64) * weights[k]
    return total


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    clients=st.integers(1, 9),
    dtype=st.sampled_from(["float32", "float64"]),
    hold=st.sampled_from([0, 400_000, 1 << 30, ON_DISK]),
    wire=st.booleans(),
)
def test_any_arrival_order_gives_the_batch_sum_bit_for_bit(
    seed: int, clients: int, dtype: str, hold: int, wire: bool
) -> None:
    """Also with every upload on disk (``ON_DISK``), summed back in blocks of 7,000
    coordinates (so the big tensor's last block is a short one), and with the uploads as a
    server decodes them (``wire``: packed back to back, summed a stretch per call)."""
    with tempfile.TemporaryDirectory() as folder:
        _check_arrival_order(seed, clients, dtype, hold, Path(folder), wire=wire)


@pytest.mark.parametrize("hold", [400_000, ON_DISK])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_compiled_kernel_gives_the_same_sums(
    seed: int, dtype: str, hold: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the kernel's threshold lowered, the big tensor (80,000 elements) is folded by
    the compiled kernel: the sums still equal the independent whole-tensor expression (odd
    seeds: decoded uploads, whose three tensors are one stretch of 80,020 elements)."""
    monkeypatch.setattr(_kernels, "KERNEL_ELEMENTS", 1 << 12)
    monkeypatch.delenv(_kernels.THREADS_ENV, raising=False)
    # 11 on disk: a group of 8, then 3
    _check_arrival_order(seed, 11, dtype, hold, tmp_path, wire=seed % 2 == 1)
    assert _kernels.kernel_info()["state"] == "loaded"


def _check_arrival_order(
    seed: int, clients: int, dtype: str, hold: int, tmp_path: Path, *, wire: bool = False
) -> None:
    rng = np.random.default_rng(seed)
    everyone = _uploads(rng, clients, dtype)
    sent = {k: _decoded(tensors) for k, tensors in everyone.items()} if wire else everyone
    weights = {k: float(rng.integers(1, 5000)) for k in everyone}
    dropped = {k for k in everyone if rng.random() < 0.3}
    arriving = [k for k in rng.permutation(clients).tolist() if k not in dropped]
    events = [("add", k) for k in arriving] + [("skip", k) for k in dropped]
    rng.shuffle(events)  # failures and uploads interleave in any order

    on_disk = hold == ON_DISK
    fold = OrderedFold(
        everyone[0], everyone, hold_bytes=max(hold, 0), spill_dir=tmp_path, on_disk=on_disk
    )
    with fold, _disk_blocks(7_000):
        for what, k in events:
            if what == "add":
                fold.add(k, sent[k], weights[k])
            else:
                fold.skip(k)
        if on_disk and arriving:
            assert len(list(next(tmp_path.iterdir()).iterdir())) == len(arriving)
        means = fold.mean() if arriving else None  # on disk: read back, block by block
        streamed = {name: value.copy() for name, value in fold.sums().items()}
        assert fold.added == sorted(arriving)
        assert fold.weight_total == sum(weights[k] for k in sorted(arriving))
    survivors = {k: everyone[k] for k in arriving}
    if not survivors:
        assert all(not value.any() for value in streamed.values())
        return
    with weighted_sum(everyone[0], survivors, weights) as batch:
        batched = batch.sums()
        for name in SHAPES:
            assert np.array_equal(streamed[name], batched[name])
        assert means is not None
        for name, mean in batch.mean().items():
            assert mean.dtype == means[name].dtype and np.array_equal(mean, means[name])
    expected = _reference(survivors, weights)
    for name in SHAPES:
        assert np.array_equal(streamed[name], expected[name])
    assert not any(tmp_path.iterdir()), "spill files are removed"


def _decoded(tensors: dict[str, np.ndarray], runs: int = 1) -> dict[str, np.ndarray]:
    """``tensors`` as a server decodes them: packed back to back in one body, ``runs``
    stretches of one dtype."""
    chunks = encode_chunks(Payload(meta={}, tensors=tensors), chunk_bytes=1 << 20)
    decoded = decode_chunks(chunks, max_message_bytes=1 << 30).tensors
    assert isinstance(decoded, PackedTensors) and len(decoded.runs() or []) == runs
    return decoded


@contextlib.contextmanager
def _disk_blocks(elements: int) -> Iterator[None]:
    """``_fold.DISK_BLOCK_ELEMENTS`` set to ``elements`` inside the block."""
    kept = _fold.DISK_BLOCK_ELEMENTS
    _fold.DISK_BLOCK_ELEMENTS = elements
    try:
        yield
    finally:
        _fold.DISK_BLOCK_ELEMENTS = kept


MEMORY_CLIENTS, MEMORY_SIZE = 24, 1_000_000
"""The memory tests' round: K uploads of 4 MB (a million float32 values each)."""


def _filled(k: int) -> dict[str, np.ndarray]:
    """Client ``k``'s upload in the memory tests: every value ``k + 1``."""
    return {"w": np.full(MEMORY_SIZE, k + 1, dtype=np.float32)}


def _start_tracing() -> None:
    """Starts tracemalloc after a collection, so that garbage left by earlier tests is gone."""
    gc.collect()
    tracemalloc.start()


def test_early_uploads_go_to_disk_beyond_the_hold_and_memory_stays_bounded(tmp_path: Path) -> None:
    """K uploads of 4 MB arriving last-first: with no hold, the fold keeps its float64
    accumulator (8 MB) and nothing else in memory; they wait on disk, in a private folder."""
    clients, size, upload = MEMORY_CLIENTS, MEMORY_SIZE, _filled
    reference, model_bytes = _filled(-1), MEMORY_SIZE * 4  # zeros
    _start_tracing()
    try:
        fold = OrderedFold(reference, range(clients), hold_bytes=0, spill_dir=tmp_path)
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        for k in reversed(range(clients)):
            fold.add(k, upload(k), 1.0)
            if k == clients - 1:
                folders = list(tmp_path.iterdir())
                assert len(folders) == 1
                assert stat.S_IMODE(folders[0].stat().st_mode) == 0o700
        _, peak = tracemalloc.get_traced_memory()
        assert fold.complete() and fold.spilled_count == clients - 1
        assert fold.peak_held_bytes == 0
        total = fold.sums()["w"]
    finally:
        tracemalloc.stop()
    assert np.array_equal(total, np.full(size, clients * (clients + 1) / 2))
    # The upload being added, one read back from disk and the block scratch: a constant
    # number of models, not K of them (K x 4 MB = 96 MB).
    assert peak - base <= 3 * model_bytes + (1 << 20), (peak - base) / model_bytes
    fold.close()
    assert not any(tmp_path.iterdir())


def test_a_fold_on_disk_holds_no_model_sized_sums(tmp_path: Path) -> None:
    """``on_disk``: K uploads of 4 MB; the fold's own memory, adding them and taking their
    mean, stays under the one model-sized array it returns plus its blocks (here 2**16
    coordinates: 0.5 MiB of sums, 8 x 256 KiB read back), where the in-memory fold keeps an
    8 MB float64 accumulator."""
    clients, size, upload = MEMORY_CLIENTS, MEMORY_SIZE, _filled
    reference, model_bytes = _filled(-1), MEMORY_SIZE * 4  # zeros
    _start_tracing()
    try:
        with _disk_blocks(1 << 16):
            fold = OrderedFold(reference, range(clients + 1), spill_dir=tmp_path, on_disk=True)
            base, _ = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            for k in reversed(range(clients)):
                fold.add(k, upload(k), 2.0)
            fold.skip(clients)
            adding, _ = tracemalloc.get_traced_memory()
            mean = fold.mean()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert fold.complete() and fold.weight_total == 2.0 * clients
    expected = np.float32(2.0 * clients * (clients + 1) / 2 / (2.0 * clients))
    assert np.array_equal(mean["w"], np.full(size, expected, dtype=np.float32))
    assert adding - base < 1 << 16  # what it keeps per upload: a weight and a dtype
    assert peak - base <= model_bytes + (3 << 20), (peak - base) / model_bytes
    files = list(next(tmp_path.iterdir()).iterdir())
    assert len(files) == clients and {f.stat().st_size for f in files} == {model_bytes}
    assert {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o600}
    fold.close()
    assert not any(tmp_path.iterdir())


def test_an_upload_the_disk_cannot_hold_leaves_nothing_and_may_come_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the first write of an upload's file stops half-way with ENOSPC
    real = os.fdopen

    def filling(descriptor: int, *args: Any, **kwargs: Any) -> Any:
        file = real(descriptor, *args, **kwargs)

        class Full:
            def __enter__(self) -> Full:
                return self

            def __exit__(self, *exc: object) -> None:
                file.close()

            def write(self, data: memoryview) -> int:
                file.write(data[: len(data) // 2])
                raise OSError(errno.ENOSPC, "No space left on device")

        return Full()

    reference = {"w": np.zeros(1000, dtype=np.float32)}
    uploads = {k: {"w": np.full(1000, k + 1, dtype=np.float32)} for k in range(2)}
    fold = OrderedFold(reference, range(2), spill_dir=tmp_path, on_disk=True)
    # Execute
    monkeypatch.setattr(os, "fdopen", filling)
    with pytest.raises(OSError, match="No space left"):
        fold.add(0, uploads[0], 1.0)
    monkeypatch.setattr(os, "fdopen", real)
    (folder,) = tmp_path.iterdir()
    left = list(folder.iterdir())
    assert not fold.taken(0) and not fold.complete()
    fold.add(0, uploads[0], 1.0)  # the disk has room again
    fold.add(1, uploads[1], 1.0)
    # Assert: nothing of the failed write stayed, and the sum is whole
    assert left == []
    assert np.array_equal(fold.mean()["w"], np.full(1000, 1.5, dtype=np.float32))
    fold.close()


def test_held_uploads_stay_within_the_hold() -> None:
    reference = {"w": np.zeros(1000, dtype=np.float32)}
    fold = OrderedFold(reference, range(6), hold_bytes=2 * 4000, spill_dir=None)
    for k in (5, 4, 3, 2, 1):  # the first two fit in the hold, the rest go to disk
        fold.add(k, {"w": np.full(1000, k, dtype=np.float32)}, 2.0)
    assert fold.peak_held_bytes == 8000 and fold.spilled_count == 3
    fold.add(0, {"w": np.zeros(1000, dtype=np.float32)}, 2.0)
    assert fold.complete() and fold.held_bytes == 0
    assert np.array_equal(fold.mean()["w"], np.full(1000, 15 * 2 / 12, dtype=np.float32))
    assert fold.mean()["w"].dtype == np.float32
    fold.close()


def test_a_held_upload_is_copied_so_its_buffer_may_be_reused() -> None:
    reference = {"w": np.zeros(4, dtype=np.float64)}
    fold = OrderedFold(reference, [0, 1])
    buffer = np.ones(4)
    fold.add(1, {"w": buffer}, 1.0)
    buffer[:] = 100.0  # a decoder reusing its buffer
    fold.add(0, {"w": np.zeros(4)}, 1.0)
    assert np.array_equal(fold.sums()["w"], np.ones(4))


MIXED_LAYOUT = {
    "w": ((3, 4), np.float32),
    "n": ((), np.int64),
    "b": ((5,), np.float32),
    "s": ((2,), np.float64),
}
"""A layout whose dtypes alternate: a decoded upload of it is four stretches."""


def test_decoded_uploads_of_mixed_dtypes_give_the_bits_of_plain_ones() -> None:
    """Decoded uploads are summed a stretch per call, held ones too (copied a stretch at a
    time); one in another order than the layout is summed a tensor at a time. Sums and mean
    are the plain dicts' bit for bit, and the mean is packed a stretch per dtype."""
    rng = np.random.default_rng(5)
    uploads = {
        k: {
            name: np.asarray(rng.standard_normal(shape) * 100).astype(dtype)
            for name, (shape, dtype) in MIXED_LAYOUT.items()
        }
        for k in range(5)
    }
    weights = {k: float(k + 1) for k in uploads}
    decoded = {k: _decoded(tensors, runs=4) for k, tensors in uploads.items()}
    decoded[3] = _decoded(dict(reversed(list(uploads[3].items()))), runs=4)
    results = []
    for uploads_of in (decoded, uploads):
        with OrderedFold(uploads[0], uploads, hold_bytes=1 << 20) as fold:
            for k in (4, 2, 3, 1, 0):  # 4, 2, 3 and 1 are held; 0 makes all five come
                fold.add(k, uploads_of[k], weights[k])
            assert fold.peak_held_bytes > 0
            results.append(({n: v.copy() for n, v in fold.sums().items()}, fold.mean()))
    (packed_sums, packed_mean), (plain_sums, plain_mean) = results
    for name in MIXED_LAYOUT:
        assert np.array_equal(packed_sums[name], plain_sums[name])
        assert packed_mean[name].dtype == plain_mean[name].dtype
        assert np.array_equal(packed_mean[name], plain_mean[name])
    expected = sum(uploads[k]["w"].astype(np.float64) * weights[k] for k in range(5))
    assert np.array_equal(packed_sums["w"], expected)
    assert isinstance(packed_mean, PackedTensors) and len(packed_mean.runs() or []) == 4


def test_a_decoded_upload_of_another_shape_is_refused_naming_the_tensor() -> None:
    reference = {"w": np.zeros((2, 3), dtype=np.float32), "b": np.zeros(3, dtype=np.float32)}
    wrong = _decoded({"w": np.zeros((3, 2), dtype=np.float32), "b": np.zeros(3, np.float32)})
    with OrderedFold(reference, [0]) as fold, pytest.raises(ProtocolError, match="'w' has shape"):
        fold.add(0, wrong, 1.0)


@pytest.mark.parametrize(
    ("action", "message"),
    [
        (lambda f: f.add(7, {"w": np.zeros(3)}, 1.0), "not planned"),
        (
            lambda f: (f.add(1, {"w": np.zeros(3)}, 1.0), f.add(1, {"w": np.zeros(3)}, 1.0)),
            "already",
        ),
        (lambda f: (f.skip(0), f.skip(0)), "already resolved"),
        (lambda f: (f.add(1, {"w": np.zeros(3)}, 1.0), f.skip(1)), "waiting for its turn"),
        (lambda f: f.add(0, {"w": np.zeros(4)}, 1.0), "shape"),
        (lambda f: f.add(0, {"v": np.zeros(3)}, 1.0), "tensors"),
        (lambda f: f.add(0, {"w": np.zeros(3)}, -1.0), "finite number >= 0"),
        (lambda f: f.add(0, {"w": np.zeros(3)}, float("nan")), "finite number >= 0"),
        (lambda f: (f.add(0, {"w": np.zeros(3)}, 1.0), f.sums()), r"clients \[1, 2\]"),
        (lambda f: (f.add(0, {"w": np.zeros(3)}, 1.0), f.reweigh(0, 2.0)), "weighed later"),
        (lambda f: (f.close(), f.add(0, {"w": np.zeros(3)}, 1.0)), "closed"),
        (lambda f: (f.skip(0), f.skip(1), f.skip(2), f.close(), f.mean()), "closed"),
    ],
)
def test_misuse_is_refused_with_a_reason(action, message: str) -> None:
    fold = OrderedFold({"w": np.zeros(3)}, [0, 1, 2])
    with pytest.raises(ProtocolError, match=message):
        action(fold)


def test_a_mean_of_nothing_is_refused() -> None:
    fold = OrderedFold({"w": np.zeros(3)}, [0])
    fold.skip(0)
    with pytest.raises(ProtocolError, match="positive sum"):
        fold.mean()


def _server(sizes: tuple[int, ...] | None, weighting: str = "ShardSize") -> ModelAveragingServer:
    initial = {"w": np.zeros((4, 3), dtype=np.float32), "b": np.zeros(3, dtype=np.float32)}
    bounds = UploadBounds(1e6, shard_sizes=sizes)
    return ModelAveragingServer(initial, weighting=weighting, bounds=bounds)


def _model_uploads(rng: np.random.Generator, clients: int) -> dict[int, Payload]:
    return {
        k: Payload(
            meta={"num_examples": int(rng.integers(1, 50)), "loss": float(rng.random())},
            tensors={
                "w": rng.standard_normal((4, 3)).astype(np.float32),
                "b": rng.standard_normal(3).astype(np.float32),
            },
        )
        for k in range(clients)
    }


@pytest.mark.parametrize("on_disk", [False, True])
@pytest.mark.parametrize("weighting", ["ShardSize", "Uniform"])
def test_a_server_that_sums_on_arrival_equals_one_that_sums_at_combine(
    weighting: str, on_disk: bool, tmp_path: Path
) -> None:
    """Also with the uploads on disk (``keep_uploads_on_disk``): each goes to a file of its
    own as it arrives, and the files are gone once the round is combined."""
    rng = np.random.default_rng(3)
    clients = 7
    uploads = _model_uploads(rng, clients)
    sizes = tuple(50 for _ in range(clients))
    streaming, batch = _server(sizes, weighting), _server(sizes, weighting)
    if on_disk:
        streaming.keep_uploads_on_disk(tmp_path)
    for server in (streaming, batch):
        server.plan_round(1, list(range(clients)))
    kept = {}
    for k in [5, 2, 6, 0, 3]:  # 1 and 4 drop out
        streaming.check_upload(1, k, uploads[k])
        stand_in = streaming.take_upload(1, k, uploads[k])
        assert stand_in is not None and not stand_in.tensors and stand_in.meta == uploads[k].meta
        kept[k] = stand_in
    if on_disk:
        (folder,) = tmp_path.iterdir()
        assert sorted(f.name for f in folder.iterdir()) == [
            f"client-{k}.bin" for k in (0, 2, 3, 5, 6)
        ]
    result = streaming.combine(1, kept, [1, 4])
    assert not any(tmp_path.iterdir())
    expected = batch.combine(1, {k: uploads[k] for k in kept}, [1, 4])  # the simulation's path
    assert result == expected
    for name, value in batch.global_weights().items():
        assert np.array_equal(streaming.global_weights()[name], value)
        assert streaming.global_weights()[name].dtype == np.float32


@pytest.mark.parametrize("hold_bytes", [0, 1 << 20, ON_DISK])
def test_uploads_wait_in_a_store_where_the_weight_needs_the_whole_round(
    hold_bytes: int, tmp_path: Path
) -> None:
    """Without shard sizes or a cap, a claim is capped at a multiple of the round's median:
    each upload waits in a store (in memory, or on disk past hold_bytes; with the uploads on
    disk, in the fold's own files, weighed at combine) and the runtime keeps its meta only;
    combine then sums them in client order, bit for bit the batch mean."""
    rng = np.random.default_rng(4)
    uploads = _model_uploads(rng, 5)
    uploads[3] = Payload(
        meta={**uploads[3].meta, "num_examples": 10**6}, tensors=uploads[3].tensors
    )
    server = _server(None)
    if hold_bytes == ON_DISK:
        server.keep_uploads_on_disk(tmp_path)
    else:
        server.hold_bytes = hold_bytes
    server.plan_round(1, list(range(5)))
    kept = {}
    for k in [4, 1, 3, 0]:  # client 2 drops out
        stand_in = server.take_upload(1, k, uploads[k])
        assert stand_in is not None and not stand_in.tensors and stand_in.meta == uploads[k].meta
        kept[k] = stand_in
    if hold_bytes == ON_DISK:
        assert server._deferred is None
        (folder,) = tmp_path.iterdir()
        assert sorted(f.name for f in folder.iterdir()) == [f"client-{k}.bin" for k in (0, 1, 3, 4)]
    else:
        store = server._deferred
        assert store is not None and store.clients == [0, 1, 3, 4]
        assert store.spilled_count == (4 if hold_bytes == 0 else 0)
        folder = store.folder
    result = server.combine(1, kept, [2])
    reference = _server(None)
    expected = reference.combine(1, {k: uploads[k] for k in kept}, [2])  # no plan: sums afresh
    assert result == expected
    for name, value in reference.global_weights().items():
        assert np.array_equal(server.global_weights()[name], value)
    assert folder is None or not folder.exists()  # the spilled uploads are gone


def test_a_redo_starts_a_fresh_sum() -> None:
    rng = np.random.default_rng(5)
    uploads = _model_uploads(rng, 3)
    server = _server((50, 50, 50))
    server.plan_round(1, [0, 1, 2])
    server.take_upload(1, 0, uploads[0])  # attempt 1: client 0 uploads, the others fail
    server.plan_round(1, [1, 2])  # attempt 2 asks the others again
    kept = {k: server.take_upload(1, k, uploads[k]) for k in (1, 2)}
    server.combine(1, {k: v for k, v in kept.items() if v is not None}, [])
    reference = _server((50, 50, 50))
    reference.combine(1, {k: uploads[k] for k in (1, 2)}, [])
    for name, value in reference.global_weights().items():
        assert np.array_equal(server.global_weights()[name], value)


def test_dp_fedavg_keeps_its_uploads_whole() -> None:
    initial = {"w": np.zeros(3, dtype=np.float32)}
    server = DpFedAvgServer(
        initial,
        clipping_norm=1.0,
        noise_multiplier=1.0,
        expected_clients=2,
        secure_noise=True,
        seed=0,
    )
    server.plan_round(1, [0, 1])
    upload = Payload(meta={"num_examples": 3}, tensors={"w": np.ones(3, dtype=np.float32)})
    assert server.take_upload(1, 0, upload) is None
