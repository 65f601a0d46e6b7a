"""Tensors packed back to back (PackedTensors, fedcore.protocols._runs): one call per stretch."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcore.protocols._bounds import step_norm
from fedcore.protocols._runs import runs_of, stretches
from fedcore.transport import PackedTensors, Payload, decode_chunks, encode_chunks

MIXED = {
    "conv": np.arange(12, dtype=np.float32).reshape(3, 4),
    "bias": np.linspace(-1, 1, 4, dtype=np.float32),
    "count": np.array(7, dtype=np.int64),
    "head": np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
    "scale": np.array([0.5, 2.0], dtype=np.float64),
}


def _wire(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``tensors`` as a receiver decodes them."""
    chunks = encode_chunks(Payload(meta={}, tensors=tensors), chunk_bytes=7)
    return decode_chunks(chunks, max_message_bytes=1 << 20).tensors


def test_a_decoded_message_packs_its_tensors_in_stretches_of_one_dtype() -> None:
    tensors = _wire(MIXED)
    assert isinstance(tensors, PackedTensors)
    runs = tensors.runs()
    assert runs is not None
    assert [(start, stop) for start, stop, _ in runs] == [(0, 2), (2, 3), (3, 4), (4, 5)]
    values = list(tensors.values())
    for start, stop, view in runs:
        assert view.ndim == 1 and view.dtype == values[start].dtype
        assert np.array_equal(view, np.concatenate([v.reshape(-1) for v in values[start:stop]]))
        assert all(np.shares_memory(view, value) for value in values[start:stop])
    for name, value in MIXED.items():
        assert tensors[name].shape == value.shape and np.array_equal(tensors[name], value)


def test_runs_alias_the_tensors_and_end_when_an_entry_is_replaced() -> None:
    tensors = _wire(MIXED)
    runs = tensors.runs()
    assert runs is not None
    tensors["bias"][1] = 42.0  # a write through a tensor shows in its run, and runs stay
    assert runs[0][2][13] == 42.0 and tensors.runs() is runs

    replaced = _wire(MIXED)
    replaced["bias"] = np.zeros(4, dtype=np.float32)
    assert replaced.runs() is None
    added = _wire(MIXED)
    added["extra"] = np.zeros(1, dtype=np.float32)
    assert added.runs() is None
    removed = _wire(MIXED)
    del removed["count"]
    assert removed.runs() is None
    assert type(copy.copy(_wire(MIXED))) is dict  # a copy is a plain dict: no stale runs


def test_a_plain_dict_is_a_run_per_tensor() -> None:
    runs = runs_of(MIXED)
    assert [(start, stop) for start, stop, _ in runs] == [(i, i + 1) for i in range(5)]
    assert all(view.ndim == 1 for _, _, view in runs)


def test_empty_like_makes_one_buffer_per_dtype_stretch() -> None:
    layout = {name: (value.shape, value.dtype) for name, value in MIXED.items()}
    made = PackedTensors.empty_like(layout)
    runs = made.runs()
    assert runs is not None and len(runs) == 4
    for name, (shape, dtype) in layout.items():
        assert made[name].shape == shape and made[name].dtype == dtype
    first = runs[0][2]
    assert np.shares_memory(first, made["conv"]) and np.shares_memory(first, made["bias"])
    assert not np.shares_memory(first, made["head"])


@st.composite
def _partitioned(draw: st.DrawFn) -> tuple[list[int], list[list[tuple[int, int]]]]:
    """Tensor sizes and, for three operands, a partition of the positions into runs."""
    sizes = draw(st.lists(st.integers(0, 6), min_size=1, max_size=9))
    partitions = []
    for _ in range(3):
        cuts = sorted(draw(st.sets(st.integers(1, len(sizes) - 1))) if len(sizes) > 1 else set())
        bounds = [0, *cuts, len(sizes)]
        partitions.append(list(itertools.pairwise(bounds)))
    return sizes, partitions


@settings(max_examples=60, deadline=None)
@given(case=_partitioned())
def test_stretches_give_every_element_once_in_order(
    case: tuple[list[int], list[list[tuple[int, int]]]],
) -> None:
    sizes, partitions = case
    rng = np.random.default_rng(len(sizes))
    operands = []
    wholes = []
    for partition in partitions:
        whole = rng.standard_normal(sum(sizes))
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        operands.append(
            [(start, stop, whole[offsets[start] : offsets[stop]]) for start, stop in partition]
        )
        wholes.append(whole)
    found = stretches(sizes, *operands)
    for which, whole in enumerate(wholes):
        parts = [views[which] for views in found]
        joined = np.concatenate(parts) if parts else np.empty(0)
        assert np.array_equal(joined, whole)
    for views in found:
        assert len({view.size for view in views}) == 1
    # no finer than needed: every stretch ends where some operand's run ends
    ends = {stop for partition in partitions for _, stop in partition}
    assert len(found) == len(ends)


def test_stretches_refuse_runs_that_do_not_match_the_sizes() -> None:
    with pytest.raises(ValueError, match="sizes"):
        stretches([2, 3], [(0, 2, np.zeros(4))])
    with pytest.raises(ValueError, match="cover"):
        stretches([2, 3], [(0, 1, np.zeros(2))])
    with pytest.raises(ValueError, match="sizes"):
        stretches([2, 3], [(0, 1, np.zeros(2)), (1, 2, np.zeros(4))])


def test_a_packed_step_norm_equals_the_tensor_by_tensor_one() -> None:
    rng = np.random.default_rng(3)
    before = {name: np.asarray(value * 1.5).astype(value.dtype) for name, value in MIXED.items()}
    after = {
        name: np.asarray(value + rng.standard_normal(value.shape)).astype(value.dtype)
        for name, value in before.items()
    }
    plain = step_norm(after, before)
    packed = step_norm(_wire(after), _wire(before))
    expected = np.sqrt(
        sum(
            float(np.sum((after[n].astype(np.float64) - before[n].astype(np.float64)) ** 2))
            for n in MIXED
            if MIXED[n].dtype.kind == "f"
        )
    )
    assert packed == pytest.approx(expected, rel=1e-12)
    assert plain == pytest.approx(expected, rel=1e-12)
    reordered = dict(reversed(list(_wire(before).items())))  # another order: a tensor each
    assert step_norm(_wire(after), reordered) == pytest.approx(expected, rel=1e-12)
