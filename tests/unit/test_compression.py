"""Tests for fedcore.transport._compression: lossy float codecs and strict decompression."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedcore.errors import MessageRejected
from fedcore.transport._compression import (
    CODECS,
    ROUNDINGS,
    compress,
    decompress,
    error_bound,
)

F16_MAX = 65504.0
F32_MAX = float(np.finfo(np.float32).max)
F64_MAX = float(np.finfo(np.float64).max)
WIRE_DTYPES = {"Float16": np.float16, "BFloat16": np.uint16, "Int8": np.int8}
COMBINATIONS = [(codec, rounding) for codec in CODECS for rounding in ROUNDINGS]
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6)


def _float_arrays(dtype: type[np.floating[Any]], limit: float) -> st.SearchStrategy[np.ndarray]:
    elements = st.floats(
        min_value=-limit,
        max_value=limit,
        width=32 if dtype is np.float32 else 64,
        allow_nan=False,
        allow_infinity=False,
    )
    return hnp.arrays(dtype, SHAPES, elements=elements)


def _domain(codec: str, dtype: type[np.floating[Any]]) -> float:
    """The largest magnitude the codec compresses for this dtype (beyond it: pass-through)."""
    if codec == "Float16":
        return F16_MAX
    if codec == "BFloat16" or dtype is np.float32:
        return F32_MAX
    return F64_MAX


def _round_trip(
    tensors: dict[str, np.ndarray], codec: str, rounding: str, seed: int = 0
) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, np.ndarray]]:
    """compress, send the description through JSON as a message would, decompress."""
    wire, description = compress(tensors, codec, rounding, np.random.default_rng(seed))
    restored = decompress(wire, json.loads(json.dumps(description)))
    return wire, description, restored


def _assert_within_bound(
    restored: np.ndarray, original: np.ndarray, codec: str, rounding: str, entry: dict[str, Any]
) -> None:
    bound = error_bound(codec, rounding, original, entry.get("scale"))
    error = np.abs(restored.astype(np.float64) - original.astype(np.float64))
    assert np.isfinite(restored).all()
    assert (error <= bound).all(), (
        f"{codec}/{rounding}: worst excess {np.max(error - bound)!r} at "
        f"{original.reshape(-1)[np.argmax((error - bound).reshape(-1))]!r}"
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("codec", "rounding"), COMBINATIONS)
def test_round_trip_keeps_layout_and_stays_within_the_error_bound(
    codec: str, rounding: str, dtype: type[np.floating[Any]], data: st.DataObject
) -> None:
    # Prepare
    values = data.draw(_float_arrays(dtype, _domain(codec, dtype)), label="values")
    counts = np.arange(3, dtype=np.int64)
    tensors = {"values": values, "counts": counts}

    # Execute
    wire, description, restored = _round_trip(tensors, codec, rounding)

    # Assert
    assert list(wire) == list(restored) == ["values", "counts"]
    assert list(description) == ["values"]
    assert description["values"]["codec"] == codec
    assert description["values"]["dtype"] == np.dtype(dtype).name
    assert wire["values"].dtype == WIRE_DTYPES[codec]
    assert wire["values"].shape == restored["values"].shape == values.shape
    assert not np.shares_memory(wire["values"], values)
    assert restored["values"].dtype == dtype
    assert restored["counts"] is counts
    _assert_within_bound(restored["values"], values, codec, rounding, description["values"])


def _between_float16(bases: list[float], fractions: list[float]) -> np.ndarray:
    low = np.array(bases, dtype=np.float16)
    high = np.nextafter(low, np.float16(np.inf))
    values = low.astype(np.float64) + np.array(fractions) * (high - low).astype(np.float64)
    return values.astype(np.float32)


def _between_bfloat16(bases: list[float], fractions: list[float]) -> np.ndarray:
    low_bits = np.array(bases, dtype=np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
    low = low_bits.view(np.float32).astype(np.float64)
    high = (low_bits + np.uint32(0x10000)).view(np.float32).astype(np.float64)
    return (low + np.array(fractions) * (high - low)).astype(np.float32)


# Values no codec represents exactly (Int8: scale 1 from the 127 in front, checked from index 1).
UNREPRESENTABLE = {
    "Float16": _between_float16([1.0, -3.0, 1000.0, 2.0**-20, 0.5], [0.3, 0.7, 0.2, 0.65, 0.8]),
    "BFloat16": _between_bfloat16([1.0, -3.0, 1e30, 1e-39, -0.5], [0.3, 0.7, 0.2, 0.65, 0.8]),
    "Int8": np.array([127.0, 0.3, -2.7, 50.2, -99.65, 3.8], dtype=np.float32),
}


@pytest.mark.parametrize("codec", CODECS)
def test_stochastic_rounding_is_unbiased_and_nearest_is_not(codec: str) -> None:
    # Prepare: 20,000 independent round trips of each value, as the rows of one tensor
    values = UNREPRESENTABLE[codec]
    trips = 20_000
    tiled = np.tile(values, (trips, 1))
    checked = slice(1, None) if codec == "Int8" else slice(None)
    exact = values.astype(np.float64)[checked]

    # Execute
    _, _, stochastic = _round_trip({"x": tiled}, codec, "Stochastic", seed=2024)
    _, _, nearest = _round_trip({"x": values}, codec, "Nearest")

    # Assert
    samples = stochastic["x"].astype(np.float64)[:, checked]
    standard_error = samples.std(axis=0, ddof=1) / math.sqrt(trips)
    tolerance = 5 * standard_error
    assert (standard_error > 0).all(), "each value must round both ways"
    assert (np.abs(samples.mean(axis=0) - exact) <= tolerance).all()
    systematic = np.abs(nearest["x"].astype(np.float64)[checked] - exact)
    assert (systematic > 5 * tolerance).all()


def _bfloat16_nearest_oracle(values: np.ndarray) -> np.ndarray:
    """Round half to even by comparing exact distances; a rounding that would reach infinity
    (the upper neighbour's bits are infinity's) keeps the lower neighbour."""
    bits = values.reshape(-1).view(np.uint32)
    down = bits & np.uint32(0xFFFF0000)
    up = down + np.uint32(0x10000)
    x = values.reshape(-1).astype(np.float64)
    with np.errstate(invalid="ignore"):
        to_down = np.abs(x - down.view(np.float32).astype(np.float64))
        to_up = np.abs(up.view(np.float32).astype(np.float64) - x)
    odd = ((down >> 16) & 1) == 1
    take_up = (to_up < to_down) | ((to_up == to_down) & odd)
    return np.where(take_up, up >> 16, down >> 16).astype(np.uint16).reshape(values.shape)


@settings(max_examples=100, deadline=None)
@given(values=_float_arrays(np.float32, F16_MAX))
def test_nearest_is_deterministic_and_float16_matches_numpy(values: np.ndarray) -> None:
    # Prepare
    tensors = {"x": values}

    # Execute
    first, _ = compress(tensors, "Float16", "Nearest", None)
    again, _ = compress(tensors, "Float16", "Nearest", np.random.default_rng(7))
    bfloat, _ = compress(tensors, "BFloat16", "Nearest", None)
    bfloat_again, _ = compress(tensors, "BFloat16", "Nearest", np.random.default_rng(7))

    # Assert
    expected = values.astype(np.float16).view(np.uint16)
    assert np.array_equal(first["x"].view(np.uint16), expected)
    assert np.array_equal(again["x"].view(np.uint16), expected)
    assert np.array_equal(bfloat["x"], _bfloat16_nearest_oracle(values))
    assert np.array_equal(bfloat_again["x"], bfloat["x"])


@settings(max_examples=100, deadline=None)
@given(values=_float_arrays(np.float32, F32_MAX))
def test_bfloat16_nearest_matches_round_half_to_even(values: np.ndarray) -> None:
    # Execute
    wire, _ = compress({"x": values}, "BFloat16", "Nearest", None)

    # Assert
    assert np.array_equal(wire["x"], _bfloat16_nearest_oracle(values))


def test_bfloat16_nearest_breaks_ties_to_even() -> None:
    # Prepare: values exactly halfway between two bfloat16 values
    high = np.array([0x3F80, 0x3F81, 0xBF80, 0xBF81, 0x0000, 0x0001, 0x7F7E], dtype=np.uint32)
    values = ((high << 16) | np.uint32(0x8000)).view(np.float32)

    # Execute
    wire, _ = compress({"x": values}, "BFloat16", "Nearest", None)

    # Assert
    expected = [0x3F80, 0x3F82, 0xBF80, 0xBF82, 0x0000, 0x0002, 0x7F7E]
    assert wire["x"].tolist() == expected
    assert np.array_equal(wire["x"], _bfloat16_nearest_oracle(values))


def test_float64_through_float32_may_round_twice_and_stays_within_the_bound() -> None:
    # Prepare: just above float16 subnormal midpoints (k + 1/2) * 2**-24 with k even: float32
    # rounds them onto the midpoint, whose tie float16 then breaks down, away from the value
    levels = np.array([2, 4, 6, 100, 1022])
    values = (levels + 0.5) * 2.0**-24 + 2.0**-50

    # Execute
    _, description, restored = _round_trip({"x": values}, "Float16", "Nearest")

    # Assert
    error = np.abs(restored["x"] - values)
    assert (error > 2.0**-25).all()  # float32 values' bound alone would not hold
    _assert_within_bound(restored["x"], values, "Float16", "Nearest", description["x"])


def test_int8_nearest_is_deterministic() -> None:
    # Prepare
    values = np.random.default_rng(3).normal(size=(40, 5)).astype(np.float32)

    # Execute
    first, first_description = compress({"x": values}, "Int8", "Nearest", None)
    again, again_description = compress({"x": values}, "Int8", "Nearest", np.random.default_rng(1))

    # Assert
    assert np.array_equal(first["x"], again["x"])
    assert first_description == again_description
    assert first_description["x"]["scale"] == float(np.max(np.abs(values))) / 127


@pytest.mark.parametrize(("codec", "fraction"), [("Float16", 2), ("BFloat16", 2), ("Int8", 4)])
def test_wire_tensors_are_smaller_by_the_codec_factor(codec: str, fraction: int) -> None:
    # Prepare
    values = np.random.default_rng(4).normal(size=(16, 33)).astype(np.float32)

    for rounding in ROUNDINGS:
        # Execute
        wire, _ = compress({"x": values}, codec, rounding, np.random.default_rng(0))

        # Assert
        assert wire["x"].nbytes * fraction == values.nbytes


@pytest.mark.parametrize(("codec", "rounding"), COMBINATIONS)
def test_tensors_that_are_not_float32_or_float64_pass_through(codec: str, rounding: str) -> None:
    # Prepare
    tensors = {
        "ints": np.arange(6, dtype=np.int64).reshape(2, 3),
        "mask": np.array([True, False, True]),
        "half": np.array([0.1, -2.0], dtype=np.float16),
        "bytes": np.arange(4, dtype=np.uint8),
        "weights": np.array([0.25, -1.5], dtype=np.float32),
    }

    # Execute
    wire, description, restored = _round_trip(tensors, codec, rounding)

    # Assert
    assert list(description) == ["weights"]
    for name in ("ints", "mask", "half", "bytes"):
        assert wire[name] is tensors[name]
        assert restored[name] is tensors[name]
    assert wire["weights"].dtype == WIRE_DTYPES[codec]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize(("codec", "rounding"), COMBINATIONS)
def test_a_tensor_with_nan_or_infinity_passes_through_unchanged(
    codec: str, rounding: str, bad: float, dtype: type[np.floating[Any]]
) -> None:
    # Prepare
    broken = np.array([1.0, bad, -2.0], dtype=dtype)
    healthy = np.array([1.0, 3.0, -2.0], dtype=dtype)

    # Execute
    wire, description, restored = _round_trip(
        {"broken": broken, "healthy": healthy}, codec, rounding
    )

    # Assert
    assert list(description) == ["healthy"]
    assert wire["broken"] is broken
    assert restored["broken"] is broken
    assert np.isfinite(restored["healthy"]).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_float16_sends_values_beyond_its_range_unchanged(
    rounding: str, dtype: type[np.floating[Any]]
) -> None:
    # Prepare
    just_over = float(np.nextafter(np.float32(F16_MAX), np.float32(np.inf)))
    tensors = {
        "over": np.array([1.0, just_over], dtype=dtype),
        "far": np.array([-1e5, 0.5], dtype=dtype),
        "edge": np.array([F16_MAX, -F16_MAX, 0.5], dtype=dtype),
    }

    # Execute
    wire, description, restored = _round_trip(tensors, "Float16", rounding)

    # Assert
    assert list(description) == ["edge"]
    assert wire["over"] is tensors["over"]
    assert wire["far"] is tensors["far"]
    assert np.array_equal(restored["edge"], tensors["edge"])


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_bfloat16_sends_float64_beyond_float32_range_unchanged(rounding: str) -> None:
    # Prepare
    huge = np.array([1e300, 1.0])

    # Execute
    wire, description, restored = _round_trip({"huge": huge}, "BFloat16", rounding)
    _, int8_description, int8_restored = _round_trip({"huge": huge}, "Int8", rounding)

    # Assert
    assert description == {}
    assert wire["huge"] is huge
    assert restored["huge"] is huge
    assert list(int8_description) == ["huge"]
    _assert_within_bound(int8_restored["huge"], huge, "Int8", rounding, int8_description["huge"])


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_bfloat16_never_turns_float32_max_into_infinity(rounding: str) -> None:
    # Prepare: many copies, so that stochastic rounding tries to round up many times
    below = float(np.nextafter(np.float32(F32_MAX), np.float32(0)))
    values = np.tile(np.array([F32_MAX, -F32_MAX, below, -below], dtype=np.float32), 500)

    # Execute
    _, description, restored = _round_trip({"x": values}, "BFloat16", rounding)

    # Assert
    assert np.isfinite(restored["x"]).all()
    _assert_within_bound(restored["x"], values, "BFloat16", rounding, description["x"])


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize(("dtype", "peak"), [(np.float32, F32_MAX), (np.float64, F64_MAX)])
def test_int8_scale_stays_finite_at_the_dtype_maximum(
    dtype: type[np.floating[Any]], peak: float, rounding: str
) -> None:
    # Prepare
    values = np.array([peak, -peak, peak / 3, 0.0], dtype=dtype)

    # Execute
    _, description, restored = _round_trip({"x": values}, "Int8", rounding)

    # Assert
    scale = description["x"]["scale"]
    assert math.isfinite(scale) and math.isfinite(127 * scale)
    assert np.isfinite(restored["x"]).all()
    _assert_within_bound(restored["x"], values, "Int8", rounding, description["x"])


@pytest.mark.parametrize("values", [[0.0, -0.0, 0.0], [5e-324, -1e-323], [1.6e-321, 5e-324]])
def test_int8_handles_zero_and_subnormal_peaks(values: list[float]) -> None:
    # Prepare
    array = np.array(values)

    for rounding in ROUNDINGS:
        # Execute
        _, description, restored = _round_trip({"x": array}, "Int8", rounding)

        # Assert
        _assert_within_bound(restored["x"], array, "Int8", rounding, description["x"])


def test_int8_float32_values_next_to_level_midpoints_stay_within_the_bound() -> None:
    # Prepare: the worst case of float32's rounding of the decompressed value
    rng = np.random.default_rng(5)
    tensors = {}
    for index in range(50):
        peak = np.float32(rng.uniform(1, 1000))
        levels = rng.integers(-126, 126, size=100)
        midpoints = ((levels + 0.5) * (float(peak) / 127)).astype(np.float32)
        tensors[f"t{index}"] = np.concatenate(
            [
                [peak],
                midpoints,
                np.nextafter(midpoints, np.float32(np.inf)),
                np.nextafter(midpoints, np.float32(-np.inf)),
            ]
        ).astype(np.float32)

    # Execute
    _, description, restored = _round_trip(tensors, "Int8", "Nearest")

    # Assert
    for name, values in tensors.items():
        _assert_within_bound(restored[name], values, "Int8", "Nearest", description[name])


@pytest.mark.parametrize("codec", CODECS)
def test_stochastic_rounding_without_rng_is_refused(codec: str) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match="rng"):
        compress({"x": np.ones(3, dtype=np.float32)}, codec, "Stochastic", None)


@pytest.mark.parametrize("codec", ["float16", "Int4", "", "FLOAT16"])
def test_an_unknown_codec_is_refused_with_the_allowed_ones(codec: str) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match="Float16, BFloat16, Int8"):
        compress({"x": np.ones(3, dtype=np.float32)}, codec, "Nearest", None)
    with pytest.raises(ValueError, match="Float16, BFloat16, Int8"):
        error_bound(codec, "Nearest", np.ones(3))


@pytest.mark.parametrize("rounding", ["nearest", "Truncate", ""])
def test_an_unknown_rounding_is_refused_with_the_allowed_ones(rounding: str) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match="Nearest, Stochastic"):
        compress({"x": np.ones(3, dtype=np.float32)}, "Float16", rounding, None)
    with pytest.raises(ValueError, match="Nearest, Stochastic"):
        error_bound("Float16", rounding, np.ones(3))


@pytest.mark.parametrize("scale", [None, -1.0, math.nan, math.inf])
def test_int8_error_bound_needs_a_valid_scale(scale: float | None) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match="scale"):
        error_bound("Int8", "Nearest", np.ones(3, dtype=np.float32), scale)


def _hostile_wire() -> dict[str, np.ndarray]:
    return {
        "h": np.array([1.0, -2.5], dtype=np.float16),
        "b": np.array([0x3F80, 0xC020], dtype=np.uint16),
        "q": np.array([127, -3], dtype=np.int8),
        "f": np.array([0.5], dtype=np.float32),
    }


VALID: dict[str, Any] = {
    "h": {"codec": "Float16", "dtype": "float32"},
    "b": {"codec": "BFloat16", "dtype": "float64"},
    "q": {"codec": "Int8", "dtype": "float32", "scale": 0.25},
}
DROP = object()


def _changed(name: str, **changes: Any) -> dict[str, Any]:
    description = copy.deepcopy(VALID)
    for key, value in changes.items():
        if value is DROP:
            del description[name][key]
        else:
            description[name][key] = value
    return description


def _replaced(name: str, entry: Any) -> dict[str, Any]:
    description = copy.deepcopy(VALID)
    description[name] = entry
    return description


HOSTILE = [
    pytest.param({}, [], None, id="description-list"),
    pytest.param({}, None, None, id="description-none"),
    pytest.param({}, "Float16", None, id="description-string"),
    pytest.param({}, 3, None, id="description-int"),
    pytest.param({}, _replaced("zz", {"codec": "Float16", "dtype": "float32"}), "zz", id="name"),
    pytest.param({}, _replaced("x" * 10_000, {"codec": "Int8"}), "x" * 10_000, id="long-name"),
    pytest.param({}, _replaced("h", "Float16"), "h", id="entry-string"),
    pytest.param({}, _replaced("h", None), "h", id="entry-none"),
    pytest.param({}, _replaced("h", ["Float16", "float32"]), "h", id="entry-list"),
    pytest.param({}, _changed("h", extra=1), "h", id="extra-key"),
    pytest.param({}, _changed("q", offset=0.0), "q", id="extra-key-int8"),
    pytest.param({}, _changed("h", codec=DROP), "h", id="no-codec"),
    pytest.param({}, _changed("h", dtype=DROP), "h", id="no-dtype"),
    pytest.param({}, _changed("h", codec="float16"), "h", id="codec-lowercase"),
    pytest.param({}, _changed("h", codec="Int4"), "h", id="codec-unknown"),
    pytest.param({}, _changed("h", codec=3), "h", id="codec-int"),
    pytest.param({}, _changed("h", codec=None), "h", id="codec-none"),
    pytest.param({}, _changed("h", codec=["Float16"]), "h", id="codec-list"),
    pytest.param({}, _changed("h", dtype="float16"), "h", id="dtype-float16"),
    pytest.param({}, _changed("b", dtype="int8"), "b", id="dtype-int8"),
    pytest.param({}, _changed("q", dtype="object"), "q", id="dtype-object"),
    pytest.param({}, _changed("h", dtype=None), "h", id="dtype-none"),
    pytest.param({}, _changed("h", dtype=["float32"]), "h", id="dtype-list"),
    pytest.param({}, _changed("b", codec="Float16"), "b", id="float16-on-uint16"),
    pytest.param({}, _changed("h", codec="BFloat16"), "h", id="bfloat16-on-float16"),
    pytest.param(
        {},
        _replaced("f", {"codec": "Int8", "dtype": "float32", "scale": 1.0}),
        "f",
        id="int8-on-float32",
    ),
    pytest.param(
        {}, _replaced("q", {"codec": "Float16", "dtype": "float32"}), "q", id="float16-on-int8"
    ),
    pytest.param({}, _changed("q", scale=DROP), "q", id="scale-missing"),
    pytest.param({}, _changed("q", scale="0.25"), "q", id="scale-string"),
    pytest.param({}, _changed("q", scale=True), "q", id="scale-bool"),
    pytest.param({}, _changed("q", scale=None), "q", id="scale-none"),
    pytest.param({}, _changed("q", scale=[0.25]), "q", id="scale-list"),
    pytest.param({}, _changed("q", scale=-0.25), "q", id="scale-negative"),
    pytest.param({}, _changed("q", scale=math.nan), "q", id="scale-nan"),
    pytest.param({}, _changed("q", scale=math.inf), "q", id="scale-inf"),
    pytest.param({}, _changed("q", scale=10**400), "q", id="scale-huge-int"),
    pytest.param({}, _changed("q", scale=1e37), "q", id="scale-overflows-float32"),
    pytest.param({}, _changed("h", scale=1.0), "h", id="float16-with-scale"),
    pytest.param({}, _changed("b", scale=1.0), "b", id="bfloat16-with-scale"),
    pytest.param({"q": np.array([-128, 1], dtype=np.int8)}, VALID, "q", id="int8-minus-128"),
    pytest.param({"h": np.array([np.inf, 1], dtype=np.float16)}, VALID, "h", id="float16-inf"),
    pytest.param({"h": np.array([np.nan], dtype=np.float16)}, VALID, "h", id="float16-nan"),
    pytest.param({"b": np.array([0x7F80], dtype=np.uint16)}, VALID, "b", id="bfloat16-inf"),
    pytest.param({"b": np.array([0xFFC1], dtype=np.uint16)}, VALID, "b", id="bfloat16-nan"),
]


@pytest.mark.parametrize(("wire_changes", "description", "name"), HOSTILE)
def test_a_hostile_description_is_rejected_naming_its_tensor(
    wire_changes: dict[str, np.ndarray], description: Any, name: str | None
) -> None:
    # Prepare
    wire = {**_hostile_wire(), **wire_changes}

    # Execute
    with pytest.raises(MessageRejected) as caught:
        decompress(wire, description)

    # Assert
    message = str(caught.value)
    if name is None:
        assert "description" in message
    else:
        assert repr(name) in message or repr(name)[:70] in message  # long names: a prefix
    assert len(message) < 300


def test_the_valid_description_the_hostile_cases_start_from_decompresses() -> None:
    # Prepare
    wire = _hostile_wire()

    # Execute
    restored = decompress(wire, VALID, max_entries=3)

    # Assert
    assert list(restored) == ["h", "b", "q", "f"]
    assert restored["h"].dtype == np.float32
    assert np.array_equal(restored["h"], [1.0, -2.5])
    assert restored["b"].dtype == np.float64
    assert np.array_equal(restored["b"], [1.0, -2.5])
    assert restored["q"].dtype == np.float32
    assert np.array_equal(restored["q"], [31.75, -0.75])
    assert restored["f"] is wire["f"]


def test_a_description_with_more_entries_than_allowed_is_rejected() -> None:
    # Execute / Assert
    with pytest.raises(MessageRejected, match="description has 3 entries"):
        decompress(_hostile_wire(), VALID, max_entries=2)
