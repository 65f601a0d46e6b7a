"""The fold's arithmetic (fedcore.protocols._kernels): the compiled kernel and the numpy path
give numpy's plain expressions' bits, and numba is loaded only where it is used."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedcore.protocols import _kernels
from fedcore.protocols._fold import OrderedFold, fold_mean

ROOT = Path(__file__).resolve().parents[2]
SMALL = 1 << 10
"""The threshold the tests lower KERNEL_ELEMENTS to, so that small arrays take the kernel."""
WEIGHTS = (0.0, 1.0, 7.0, 1e-3, 123.456)
SIZES = (1, 7, SMALL, 3 * _kernels.BLOCK_ELEMENTS + 17)
"""One element, a remainder, the threshold, and several numpy blocks plus a remainder."""
KERNEL_SIZES = tuple(size for size in SIZES if size >= SMALL)
"""The sizes that take the kernel at the lowered threshold."""


def _bits(array: np.ndarray) -> np.ndarray:
    return array.view(f"u{array.dtype.itemsize}")


def assert_same_bits(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    different = np.flatnonzero(_bits(got).reshape(-1) != _bits(expected).reshape(-1))
    assert different.size == 0, (
        f"{different.size} elements differ, first at {different[:5]}: "
        f"{got.reshape(-1)[different[:5]]} != {expected.reshape(-1)[different[:5]]}"
    )


def _values(rng: np.random.Generator, size: int, dtype: str) -> np.ndarray:
    """Values over the dtype's whole range, with NaN, +-inf, +-0.0, subnormals, the largest
    finite values and 1 among them."""
    info = np.finfo(dtype)
    top = int(np.log10(float(info.max))) - 1
    low = int(np.log10(float(info.smallest_subnormal))) + 1
    values = rng.standard_normal(size) * 10.0 ** rng.integers(low, top, size=size)
    with np.errstate(over="ignore", under="ignore"):
        values = values.astype(dtype)
    special = np.array(
        [
            np.nan,
            np.inf,
            -np.inf,
            -0.0,
            0.0,
            info.smallest_subnormal,
            -info.smallest_subnormal * 3,
            info.max,
            -info.max,
            info.tiny,
            1.0,
        ],
        dtype=dtype,
    )
    where = rng.choice(size, size=min(size, 3 * special.size), replace=False)
    values[where] = np.resize(special, where.size)
    return values


_REAL_FOLD_NUMPY = _kernels._fold_numpy
_REAL_DIVIDE_NUMPY = _kernels._divide_numpy


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Arrays from SMALL elements take the kernel: the numpy path fails the test when it is
    given one the kernel should have taken (float32/float64, contiguous)."""
    monkeypatch.delenv(_kernels.THREADS_ENV, raising=False)
    monkeypatch.setattr(_kernels, "KERNEL_ELEMENTS", SMALL)

    def kernel_should_take(array: np.ndarray) -> bool:
        return (
            array.size >= SMALL
            and array.dtype in (np.float32, np.float64)
            and array.flags.c_contiguous
        )

    def fold_numpy(acc: np.ndarray, flat: np.ndarray, *args: Any, **options: Any) -> None:
        assert not kernel_should_take(flat), "numpy folded what the kernel should have"
        _REAL_FOLD_NUMPY(acc, flat, *args, **options)

    def divide_numpy(out: np.ndarray, *args: Any) -> None:
        assert not kernel_should_take(out), "numpy divided what the kernel should have"
        _REAL_DIVIDE_NUMPY(out, *args)

    monkeypatch.setattr(_kernels, "_fold_numpy", fold_numpy)
    monkeypatch.setattr(_kernels, "_divide_numpy", divide_numpy)
    yield
    assert _kernels.kernel_info()["state"] == "loaded", _kernels.kernel_info()


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> _kernels._Loader:
    """A loader of its own (turning it off does not turn off the process's)."""
    loader = _kernels._Loader()
    monkeypatch.setattr(_kernels, "_loader", loader)
    monkeypatch.delenv(_kernels.THREADS_ENV, raising=False)
    return loader


def _reference_fold(acc: np.ndarray, flat: np.ndarray, weight: float) -> None:
    """The plain numpy expression."""
    acc += weight * flat.astype(np.float64)


def _check_fold(rng: np.random.Generator, size: int, dtype: str) -> None:
    acc = rng.standard_normal(size) * 1e3
    expected = acc.copy()
    flat = _values(rng, size, dtype)
    with np.errstate(all="ignore"):
        for weight in WEIGHTS:
            _kernels.fold_into(acc, flat, weight)
            _reference_fold(expected, flat, weight)
            assert_same_bits(acc, expected)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("size", KERNEL_SIZES)
def test_the_kernel_folds_bit_for_bit(kernel: None, dtype: str, size: int) -> None:
    _check_fold(np.random.default_rng(size), size, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("count", [2, 3, 4, 5, 9])
@pytest.mark.parametrize("fused", [True, False])
def test_several_uploads_fold_in_one_pass_bit_for_bit(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    dtype: str,
    count: int,
    fused: bool,
) -> None:
    # Prepare: uploads over the dtype's whole range (NaN, infinities, subnormals), the fused
    # kernels (numpy may not fold any of them), or with the kernels off numpy one at a time
    if fused:
        request.getfixturevalue("kernel")
    else:
        monkeypatch.setenv(_kernels.THREADS_ENV, "0")
    rng = np.random.default_rng(count)
    size = 3 * SMALL + 5
    acc = rng.standard_normal(size) * 1e3
    expected = acc.copy()
    flats = [_values(rng, size, dtype) for _ in range(count)]
    weights = [WEIGHTS[k % len(WEIGHTS)] + k for k in range(count)]

    # Execute
    with np.errstate(all="ignore"):
        _kernels.fold_many_into(acc, flats, weights)
        for flat, weight in zip(flats, weights, strict=True):
            _reference_fold(expected, flat, weight)

    # Assert: the same bits as the uploads folded one after another
    assert_same_bits(acc, expected)


@pytest.mark.parametrize("count", [1, 2, 3, 9])
@pytest.mark.parametrize("fused", [True, False])
def test_a_fold_that_overwrites_never_reads_the_accumulator_and_gives_a_zeroed_one_s_bits(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, count: int, fused: bool
) -> None:
    """``overwrite`` starts from 0.0, not from what the accumulator holds (garbage here):
    0.0 + w * x, so a negative zero term gives +0.0 as a zeroed accumulator does (the
    weights include 0.0, whose products with negative values are -0.0)."""
    # Prepare: an accumulator of NaN, uploads over float32's whole range
    if fused:
        request.getfixturevalue("kernel")
    else:
        monkeypatch.setenv(_kernels.THREADS_ENV, "0")
    rng = np.random.default_rng(40 + count)
    size = 3 * SMALL + 5
    flats = [_values(rng, size, "float32") for _ in range(count)]
    weights = [WEIGHTS[k % len(WEIGHTS)] + k for k in range(count)]
    single = np.full(size, np.nan)
    many = np.full(size, np.nan)
    expected = np.zeros(size)

    # Execute
    with np.errstate(all="ignore"):
        _kernels.fold_into(single, flats[0], weights[0], overwrite=True)
        _kernels.fold_many_into(many, flats, weights, overwrite=True)
        first = np.zeros(size)
        _reference_fold(first, flats[0], weights[0])
        for flat, weight in zip(flats, weights, strict=True):
            _reference_fold(expected, flat, weight)

    # Assert
    negative_terms = np.signbit(flats[0]) & (flats[0] != 0)  # times weight 0.0: -0.0 terms
    assert weights[0] == 0.0 and negative_terms.any()
    assert not np.signbit(first[first == 0]).any()  # 0.0 + -0.0 is +0.0
    assert_same_bits(single, first)
    assert_same_bits(many, expected)


def test_a_fold_of_no_uploads_that_overwrites_leaves_zeros() -> None:
    acc = np.full(5, np.nan)
    _kernels.fold_many_into(acc, [], [], overwrite=True)
    assert_same_bits(acc, np.zeros(5))


def test_uploads_held_for_their_turn_are_summed_together_to_the_same_bits(kernel: None) -> None:
    # Prepare: five uploads (a float32 tensor taking the kernel, a small float64 one that
    # does not); clients 1-4 arrive before client 0, so they wait, and client 0's arrival
    # sums all five, several per pass
    rng = np.random.default_rng(8)
    reference = {"w": np.zeros(4 * SMALL, np.float32), "b": np.zeros(9, np.float64)}
    uploads = {
        k: {n: (rng.standard_normal(v.shape) * 10).astype(v.dtype) for n, v in reference.items()}
        for k in range(5)
    }
    weights = {k: 1.0 + k / 3 for k in range(5)}
    streamed = OrderedFold(reference, range(5))

    # Execute
    for k in (4, 2, 3, 1, 0):
        streamed.add(k, uploads[k], weights[k])
    one_by_one = {n: np.zeros(v.size) for n, v in reference.items()}
    for k in range(5):
        for n, value in uploads[k].items():
            _reference_fold(one_by_one[n], value.reshape(-1), weights[k])

    # Assert
    for name in reference:
        assert_same_bits(streamed.sums()[name], one_by_one[name])
    assert streamed.weight_total == sum(weights[k] for k in range(5))
    compiled = _kernels.kernel_info()["compile_seconds"]
    assert any(label.startswith("start4(") for label in compiled), compiled
    streamed.close()


def test_fold_many_refuses_mismatched_arguments() -> None:
    acc = np.zeros(8)
    with pytest.raises(ValueError, match="2 arrays but 1 weights"):
        _kernels.fold_many_into(acc, [np.ones(8), np.ones(8)], [1.0])
    with pytest.raises(ValueError, match="shape"):
        _kernels.fold_many_into(acc, [np.ones(8), np.ones(7)], [1.0, 1.0])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("size", SIZES)
def test_the_numpy_path_folds_bit_for_bit(dtype: str, size: int) -> None:
    assert size < _kernels.KERNEL_ELEMENTS
    _check_fold(np.random.default_rng(size), size, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_nan_meeting_a_nan_stays_a_nan(kernel: None, dtype: str) -> None:
    """When both operands are NaN (with different payloads), which payload survives is not
    fixed, in numpy either; everything else keeps numpy's bits."""
    rng = np.random.default_rng(1)
    acc = np.zeros(4 * SMALL + 3)
    expected = acc.copy()
    with np.errstate(all="ignore"):
        for payload in (0x11, 0x22):
            flat = _values(rng, acc.size, dtype)
            flat[::5] = np.nan
            _bits(flat)[::5] |= payload
            _kernels.fold_into(acc, flat, 3.0)
            _reference_fold(expected, flat, 3.0)
    nan = np.isnan(expected)
    assert nan[::5].all() and np.array_equal(np.isnan(acc), nan)
    assert_same_bits(acc[~nan], expected[~nan])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(
    ("path", "size"),
    [("kernel", size) for size in KERNEL_SIZES] + [("numpy", size) for size in SIZES],
)
def test_divide_into_casts_the_quotient_bit_for_bit(
    request: pytest.FixtureRequest, path: str, dtype: str, size: int
) -> None:
    if path == "kernel":
        request.getfixturevalue("kernel")
    rng = np.random.default_rng(size)
    acc = _values(rng, size, "float64")
    with np.errstate(all="ignore"):
        for total in (1.0, 3.0, 7e-3, 1e-300, 0.0, 123456789.0):
            out = np.empty(size, dtype=dtype)
            _kernels.divide_into(out, acc, total)
            assert_same_bits(out, (acc / total).astype(dtype))


@pytest.mark.parametrize("dtype", ["float16", "int16", "int64", ">f4", "bool"])
def test_other_dtypes_take_the_numpy_path_with_numpys_bits(kernel: None, dtype: str) -> None:
    """dtypes the kernel is not compiled for, and strided uploads."""
    rng = np.random.default_rng(2)
    flat = (rng.standard_normal(2 * SMALL) * 100).astype(dtype)
    acc, expected = np.zeros(flat.size), np.zeros(flat.size)
    for weight in WEIGHTS:
        _kernels.fold_into(acc, flat, weight)
        _reference_fold(expected, flat, weight)
    assert_same_bits(acc, expected)
    out = np.empty(flat.size, dtype=dtype)
    with np.errstate(all="ignore"):
        _kernels.divide_into(out, acc, 3.0)
        assert_same_bits(out, (acc / 3.0).astype(dtype))
    # A strided upload takes the numpy path too.
    strided = (rng.standard_normal(4 * SMALL)).astype(np.float32)[::2]
    before = acc.copy()
    _kernels.fold_into(acc, strided, 2.0)
    _reference_fold(before, strided, 2.0)
    assert_same_bits(acc, before)


def test_an_array_above_the_real_threshold_takes_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a lowered threshold: a tensor of KERNEL_ELEMENTS + 3 float32 values takes the
    kernel, a small one numpy, and OrderedFold's mean equals the plain expressions."""
    monkeypatch.delenv(_kernels.THREADS_ENV, raising=False)
    taken: list[int] = []

    def counted(acc: np.ndarray, *args: Any, **options: Any) -> None:
        taken.append(acc.size)
        _REAL_FOLD_NUMPY(acc, *args, **options)

    monkeypatch.setattr(_kernels, "_fold_numpy", counted)
    rng = np.random.default_rng(3)
    size = _kernels.KERNEL_ELEMENTS + 3
    uploads = [
        {"big": rng.standard_normal(size, dtype=np.float32), "b": rng.standard_normal(5)}
        for _ in range(3)
    ]
    weights = [3.0, 1.0, 250.0]
    mean = fold_mean(uploads, weights)
    assert taken == [5, 5, 5]  # only the small tensor took numpy's path
    for name in ("big", "b"):
        total = np.zeros(uploads[0][name].size)
        for upload, weight in zip(uploads, weights, strict=True):
            total += weight * upload[name].astype(np.float64)
        assert_same_bits(mean[name], (total / sum(weights)).astype(uploads[0][name].dtype))
    assert _kernels.kernel_info()["state"] == "loaded"


@pytest.mark.parametrize("path", ["kernel", "numpy"])
def test_mean_equals_the_previous_expression_without_a_float64_model(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """OrderedFold.mean() == (sums / total).astype(dtype), each dtype, a 0-d tensor
    included, and it no longer allocates a float64 copy of the model to get there."""
    if path == "kernel":
        request.getfixturevalue("kernel")
    else:
        monkeypatch.setattr(_kernels, "KERNEL_ELEMENTS", 1 << 40)
    rng = np.random.default_rng(4)
    reference = {
        "w": np.zeros((300, 1000), dtype=np.float32),
        "d": np.zeros(4000, dtype=np.float64),
        "count": np.zeros((), dtype=np.int64),
        "h": np.zeros(SMALL + 1, dtype=np.float16),
    }
    fold = OrderedFold(reference, range(3), hold_bytes=0)
    for k, weight in enumerate((1.0, 2.0, 1e-3)):
        upload = {
            n: (rng.standard_normal(v.shape) * 10).astype(v.dtype) for n, v in reference.items()
        }
        fold.add(k, upload, weight)
    sums = {name: value.copy() for name, value in fold.sums().items()}
    tracemalloc.start()
    try:
        mean = fold.mean()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    result_bytes = sum(value.nbytes for value in mean.values())
    assert peak <= result_bytes + (300 << 10), (peak, result_bytes)  # + one block of scratch
    for name, value in reference.items():
        expected = np.asarray((sums[name] / fold.weight_total).astype(value.dtype, copy=False))
        assert mean[name].shape == value.shape
        assert_same_bits(mean[name], expected)
    fold.close()


def test_without_numba_the_numpy_path_gives_the_same_bits(
    fresh: _kernels._Loader, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_kernels, "KERNEL_ELEMENTS", SMALL)
    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` raises ImportError
    rng = np.random.default_rng(5)
    flat = _values(rng, 4 * SMALL, "float32")
    acc, expected = np.zeros(flat.size), np.zeros(flat.size)
    with caplog.at_level(logging.WARNING, logger=_kernels.__name__), np.errstate(all="ignore"):
        for weight in WEIGHTS:
            _kernels.fold_into(acc, flat, weight)
            _reference_fold(expected, flat, weight)
        out = np.empty(flat.size, dtype=np.float32)
        _kernels.divide_into(out, acc, 7.0)
        assert_same_bits(out, (acc / 7.0).astype(np.float32))
    assert_same_bits(acc, expected)
    info = _kernels.kernel_info()
    assert info["state"] == "unavailable" and "numba cannot be used" in info["reason"]
    warnings = [r for r in caplog.records if "kernel is off" in r.getMessage()]
    assert len(warnings) == 1, "logged once"


def test_a_kernel_that_fails_to_compile_leaves_the_numpy_path(
    fresh: _kernels._Loader, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_kernels, "KERNEL_ELEMENTS", SMALL)

    def failing(*args: object) -> None:
        raise RuntimeError("TypingError: no implementation")

    def compile_broken(numba: object) -> dict[str, object]:
        return {"fold": failing, "divide": failing}

    monkeypatch.setattr(_kernels, "_compile", compile_broken)
    flat = np.random.default_rng(6).standard_normal(2 * SMALL).astype(np.float32)
    acc, expected = np.ones(flat.size), np.ones(flat.size)
    _kernels.fold_into(acc, flat, 7.0)
    _reference_fold(expected, flat, 7.0)
    assert_same_bits(acc, expected)
    info = _kernels.kernel_info()
    assert info["state"] == "unavailable" and "failed to compile" in info["reason"], info


def test_fold_threads_zero_turns_the_kernel_off(
    fresh: _kernels._Loader, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(_kernels.THREADS_ENV, "0")
    monkeypatch.setattr(_kernels, "KERNEL_ELEMENTS", SMALL)
    acc = np.zeros(2 * SMALL)
    _kernels.fold_into(acc, np.ones(acc.size, dtype=np.float32), 2.0)
    assert np.array_equal(acc, np.full(acc.size, 2.0))
    assert _kernels.kernel_info() == {"state": "off"}
    assert fresh.kernels is None


def test_the_thread_count_follows_the_setting(
    kernel: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(_kernels.THREADS_ENV, "1")
    rng = np.random.default_rng(7)
    flat = rng.standard_normal(3 * SMALL).astype(np.float32)
    acc, expected = np.zeros(flat.size), np.zeros(flat.size)
    _kernels.fold_into(acc, flat, 5.0)
    _reference_fold(expected, flat, 5.0)
    assert_same_bits(acc, expected)
    assert _kernels.kernel_info()["threads"] == 1
    assert _kernels.fold_threads() == 1
    monkeypatch.setenv(_kernels.THREADS_ENV, "many")
    assert _kernels.fold_threads() == max(1, _kernels.usable_cores() // 2)
    monkeypatch.delenv(_kernels.THREADS_ENV)
    assert 1 <= _kernels.usable_cores() <= len(os.sched_getaffinity(0))


def test_threads_folding_at_once_each_get_their_sum(kernel: None) -> None:
    """Kernels run one at a time in a process (numba's workqueue refuses concurrent
    launches); folds from several threads all complete, each with its own bits."""
    rng = np.random.default_rng(8)
    flats = [rng.standard_normal(5 * SMALL).astype(np.float32) for _ in range(4)]
    accs = [np.zeros(5 * SMALL) for _ in flats]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for weight in (1.0, 2.0, 3.0) * 5:
                _kernels.fold_into(accs[i], flats[i], weight)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(flats))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for acc, flat in zip(accs, flats, strict=True):
        expected = np.zeros(flat.size)
        for weight in (1.0, 2.0, 3.0) * 5:
            _reference_fold(expected, flat, weight)
        assert_same_bits(acc, expected)


NORM_SIZES = (SMALL, 3 * _kernels.NORM_BLOCK + 17)
"""The lowered threshold, and several of the norm's blocks plus a remainder."""


def _float64_squares(flat: np.ndarray, ref: np.ndarray | None) -> float:
    """The plain numpy expression, in float64."""
    d = flat.astype(np.float64) - (0.0 if ref is None else ref.astype(np.float64))
    return float(np.dot(d, d))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("size", NORM_SIZES)
@pytest.mark.parametrize("differ", [True, False])
def test_squared_distance_kernel_agrees_with_numpy_and_ignores_the_thread_count(
    kernel: None, monkeypatch: pytest.MonkeyPatch, dtype: str, size: int, differ: bool
) -> None:
    # Prepare: the numpy path counts its calls (the kernel must take these arrays)
    calls: list[int] = []
    real = _kernels._squares_numpy

    def counted(flat: np.ndarray, *args: Any) -> float:
        calls.append(flat.size)
        return real(flat, *args)

    monkeypatch.setattr(_kernels, "_squares_numpy", counted)
    rng = np.random.default_rng(size)
    flat = (rng.standard_normal(size) * 1e3).astype(dtype)
    ref = (flat + rng.standard_normal(size)).astype(dtype) if differ else None
    sums = {}

    # Execute
    for threads in ("1", "2"):
        monkeypatch.setenv(_kernels.THREADS_ENV, threads)
        sums[threads] = _kernels.squared_distance(flat, ref)
    monkeypatch.setenv(_kernels.THREADS_ENV, "0")
    numpy_sum = _kernels.squared_distance(flat, ref)
    monkeypatch.delenv(_kernels.THREADS_ENV)

    # Assert
    assert calls == [size]  # only the kernels-off call
    assert sums["1"] == sums["2"]  # bit for bit, whatever the threads
    expected = _float64_squares(flat, ref)
    assert sums["1"] == pytest.approx(expected, rel=1e-12)
    assert numpy_sum == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("path", ["kernel", "numpy"])
def test_squared_distance_is_not_finite_when_a_value_is_not(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, bad: float, path: str
) -> None:
    # Prepare
    if path == "kernel":
        request.getfixturevalue("kernel")
    else:
        monkeypatch.setenv(_kernels.THREADS_ENV, "0")
    flat = np.ones(3 * _kernels.NORM_BLOCK + 5, dtype=np.float32)
    flat[_kernels.NORM_BLOCK + 3] = bad
    ref = np.zeros_like(flat)

    # Execute
    with np.errstate(invalid="ignore"):
        found = _kernels.squared_distance(flat, ref)

    # Assert
    assert np.isnan(found) if np.isnan(bad) else found == np.inf


def test_squared_distance_refuses_arrays_that_do_not_line_up() -> None:
    with pytest.raises(ValueError, match="1-D C-contiguous"):
        _kernels.squared_distance(np.zeros(4), np.zeros(5))
    with pytest.raises(ValueError, match="1-D C-contiguous"):
        _kernels.squared_distance(np.zeros((2, 2)))
    with pytest.raises(ValueError, match="1-D C-contiguous"):
        _kernels.squared_distance(np.zeros(8)[::2])


def test_misuse_is_refused() -> None:
    with pytest.raises(ValueError, match="float64"):
        _kernels.fold_into(np.zeros(3, dtype=np.float32), np.zeros(3), 1.0)
    with pytest.raises(ValueError, match="shape"):
        _kernels.fold_into(np.zeros(3), np.zeros(4), 1.0)
    with pytest.raises(ValueError, match="C-contiguous"):
        _kernels.divide_into(np.zeros(6)[::2], np.zeros(3), 1.0)
    acc = np.zeros(8)
    with pytest.raises(ValueError, match="overlaps"):
        _kernels.fold_into(acc[:4], acc[2:6], 1.0)
    with pytest.raises(ValueError, match="overlaps"):
        _kernels.divide_into(acc[:4], acc[:4], 2.0)
    with pytest.raises(ValueError, match="scratch"):
        _kernels.fold_into(np.zeros(3), np.zeros(3), 1.0, scratch=np.zeros(0))


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != _kernels.THREADS_ENV}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env={**environment, **env},
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_a_small_model_never_imports_numba() -> None:
    """Importing fedcore and folding a model below the threshold (the quickstart's size)
    leaves numba unimported; so does a large one with the kernels off."""
    done = _python(
        """
        import sys
        import numpy as np
        import fedcore, fedcore.protocols
        from fedcore.protocols._fold import fold_mean
        from fedcore.protocols import _kernels
        assert "numba" not in sys.modules, "imported with fedcore"
        model = {"w": np.ones((64, 128), np.float32), "b": np.ones(10, np.float32)}
        fold_mean([model] * 5, [1.0] * 5)
        assert "numba" not in sys.modules, "imported by a small fold"
        assert _kernels.kernel_info() == {"state": "not loaded"}
        print("ok")
        """
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    done = _python(
        """
        import sys
        import numpy as np
        from fedcore.protocols._fold import fold_mean
        big = {"w": np.ones(1 << 21, np.float32)}
        fold_mean([big] * 2, [1.0, 1.0])
        assert "numba" not in sys.modules
        print("ok")
        """,
        FEDCORE_FOLD_THREADS="0",
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_child_forked_after_the_kernel_ran_folds_with_numpy() -> None:
    """GNU OpenMP cannot run in a child forked after it started: such a child takes the
    numpy path (same bits) instead of aborting."""
    done = _python(
        f"""
        import os
        import numpy as np
        from fedcore.protocols import _kernels
        _kernels.KERNEL_ELEMENTS = {SMALL}
        flat = np.random.default_rng(0).standard_normal(8 * {SMALL}).astype(np.float32)
        acc = np.zeros(flat.size)
        _kernels.fold_into(acc, flat, 3.0)
        assert _kernels.kernel_info()["state"] == "loaded"
        expected = acc + 3.0 * flat.astype(np.float64)
        pid = os.fork()
        if pid == 0:
            child = acc.copy()
            _kernels.fold_into(child, flat, 3.0)
            info = _kernels.kernel_info()
            ok = np.array_equal(child, expected) and "forked" in info.get("reason", "")
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        _kernels.fold_into(acc, flat, 3.0)  # the parent keeps its kernel
        assert np.array_equal(acc, expected)
        assert _kernels.kernel_info()["state"] == "loaded"
        print("ok")
        """
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
