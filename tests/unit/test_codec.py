"""Tests for fedcore.transport._codec: chunked Payload encoding and strict decoding."""

from __future__ import annotations

import itertools
import json
import struct
import tracemalloc
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedcore.errors import MessageRejected, TransportError
from fedcore.transport import Payload, PayloadDecoder, decode_chunks, encode_chunks
from fedcore.transport._codec import unviewed

ALLOWED_DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
]
LIMIT = 1 << 20


def _encode(payload: Payload, chunk_bytes: int = 1 << 16) -> bytes:
    return b"".join(encode_chunks(payload, chunk_bytes=chunk_bytes))


def _assert_same_payload(actual: Payload, expected: Payload) -> None:
    assert actual.meta == expected.meta
    assert list(actual.tensors) == list(expected.tensors)
    for name, array in expected.tensors.items():
        decoded = actual.tensors[name]
        assert decoded.dtype == array.dtype.newbyteorder("=")
        assert decoded.shape == array.shape
        assert decoded.tobytes() == array.astype(decoded.dtype).tobytes()


def _message(header: Any, body: bytes = b"", *, raw_header: bytes | None = None) -> bytes:
    header_bytes = raw_header if raw_header is not None else json.dumps(header).encode()
    return b"FCM1" + struct.pack("<I", len(header_bytes)) + header_bytes + body


def _valid_header() -> dict[str, Any]:
    return {
        "meta": {"round": 1},
        "tensors": [
            {"name": "a", "dtype": "float32", "shape": [2, 3], "offset": 0, "nbytes": 24},
            {"name": "b", "dtype": "int64", "shape": [], "offset": 24, "nbytes": 8},
        ],
        "body_bytes": 32,
    }


def _mutated(change: Any) -> bytes:
    header = _valid_header()
    change(header)
    return _message(header, bytes(32))


def _pop_key(mapping: dict[str, Any], key: str) -> None:
    del mapping[key]


# Each row: a message that must be refused, and a fragment of the expected error message.
REJECTED_MESSAGES: dict[str, tuple[bytes, str]] = {
    "wrong_magic": (b"FCM2" + _message(_valid_header(), bytes(32))[4:], "magic"),
    "wrong_magic_first_byte": (b"X", "magic"),
    "header_length_over_limit": (b"FCM1" + struct.pack("<I", (1 << 20) + 1), "over the limit"),
    "zero_length_header": (_message(None, raw_header=b""), "not valid JSON"),
    "invalid_utf8": (_message(None, raw_header=b'{"meta": "\xff\xfe"}'), "UTF-8"),
    "invalid_json": (_message(None, raw_header=b"{not json"), "not valid JSON"),
    "header_not_object": (_message([1, 2]), "JSON object"),
    "duplicate_json_key": (
        _message(None, raw_header=b'{"meta":{},"tensors":[],"body_bytes":0,"meta":{}}'),
        "repeats",
    ),
    "unknown_top_key": (_mutated(lambda h: h.update(extra=1)), "expected exactly"),
    "missing_top_key": (_mutated(lambda h: _pop_key(h, "meta")), "expected exactly"),
    "meta_not_object": (_mutated(lambda h: h.update(meta=[1])), "meta"),
    "tensors_not_list": (_mutated(lambda h: h.update(tensors={})), "JSON list"),
    "entry_not_object": (_mutated(lambda h: h["tensors"].__setitem__(0, "a")), "JSON object"),
    "entry_unknown_key": (
        _mutated(lambda h: h["tensors"][0].update(strides=[12, 4])),
        "expected exactly",
    ),
    "entry_missing_key": (_mutated(lambda h: _pop_key(h["tensors"][0], "offset")), "expected"),
    "name_empty": (_mutated(lambda h: h["tensors"][0].update(name="")), "name"),
    "name_not_string": (_mutated(lambda h: h["tensors"][0].update(name=7)), "name"),
    "name_too_long": (_mutated(lambda h: h["tensors"][0].update(name="n" * 257)), "name"),
    "duplicate_names": (_mutated(lambda h: h["tensors"][1].update(name="a")), "more than once"),
    "unknown_dtype_object": (_mutated(lambda h: h["tensors"][0].update(dtype="object")), "dtype"),
    "unknown_dtype_complex": (
        _mutated(lambda h: h["tensors"][0].update(dtype="complex64")),
        "dtype",
    ),
    "dtype_with_byteorder": (_mutated(lambda h: h["tensors"][0].update(dtype=">f4")), "dtype"),
    "dtype_not_string": (_mutated(lambda h: h["tensors"][0].update(dtype=4)), "dtype"),
    "shape_negative": (_mutated(lambda h: h["tensors"][0].update(shape=[-2, -3])), "shape"),
    "shape_float": (_mutated(lambda h: h["tensors"][0].update(shape=[2.0, 3])), "shape"),
    "shape_bool": (_mutated(lambda h: h["tensors"][1].update(shape=[True])), "shape"),
    "shape_not_list": (_mutated(lambda h: h["tensors"][0].update(shape=6)), "shape"),
    "shape_too_many_dims": (_mutated(lambda h: h["tensors"][1].update(shape=[1] * 33)), "shape"),
    "nbytes_mismatch": (_mutated(lambda h: h["tensors"][0].update(nbytes=20)), "nbytes"),
    "nbytes_not_int": (_mutated(lambda h: h["tensors"][0].update(nbytes="24")), "nbytes"),
    "offset_not_from_zero": (_mutated(lambda h: h["tensors"][0].update(offset=4)), "offset"),
    "offset_gap": (_mutated(lambda h: h["tensors"][1].update(offset=28)), "offset"),
    "offsets_out_of_order": (
        _mutated(lambda h: (h["tensors"][0].update(offset=8), h["tensors"][1].update(offset=0))),
        "offset",
    ),
    "body_bytes_mismatch": (_mutated(lambda h: h.update(body_bytes=31)), "add up"),
    "body_bytes_negative": (_mutated(lambda h: h.update(body_bytes=-1)), "body_bytes"),
    "body_bytes_not_int": (_mutated(lambda h: h.update(body_bytes="32")), "body_bytes"),
    "body_bytes_over_limit": (
        _message(
            {
                "meta": {},
                "tensors": [
                    {
                        "name": "w",
                        "dtype": "uint8",
                        "shape": [LIMIT + 1],
                        "offset": 0,
                        "nbytes": LIMIT + 1,
                    }
                ],
                "body_bytes": LIMIT + 1,
            }
        ),
        "over the limit",
    ),
    "more_bytes_than_announced": (_message(_valid_header(), bytes(33)), "longer than announced"),
}


@pytest.mark.parametrize("dtype", ALLOWED_DTYPES)
def test_codec_round_trip_every_allowed_dtype(dtype: str) -> None:
    # Prepare
    rng = np.random.default_rng(0)
    array = (rng.standard_normal((3, 4)) * 100).astype(dtype)
    payload = Payload(meta={"dtype": dtype}, tensors={"x": array})

    # Execute
    decoded = decode_chunks(encode_chunks(payload, chunk_bytes=5), max_message_bytes=LIMIT)

    # Assert
    _assert_same_payload(decoded, payload)


def test_codec_round_trip_zero_dim_and_empty_tensors() -> None:
    # Prepare
    payload = Payload(
        tensors={
            "scalar": np.array(3.5, dtype=np.float64),
            "empty": np.zeros((0,), dtype=np.float32),
            "empty_nd": np.zeros((3, 0, 2), dtype=np.int16),
            "after": np.arange(4, dtype=np.uint8),
        }
    )

    # Execute
    decoded = decode_chunks(encode_chunks(payload, chunk_bytes=3), max_message_bytes=LIMIT)

    # Assert
    _assert_same_payload(decoded, payload)
    assert decoded.tensors["scalar"].shape == ()


def test_codec_round_trip_many_tensors() -> None:
    # Prepare
    tensors = {f"layer.{i}.weight": np.full((i % 5, 3), i, dtype=np.float32) for i in range(300)}
    payload = Payload(meta={"round": 7}, tensors=tensors)

    # Execute
    decoded = decode_chunks(encode_chunks(payload, chunk_bytes=64), max_message_bytes=LIMIT)

    # Assert
    _assert_same_payload(decoded, payload)


def test_codec_round_trip_meta_only() -> None:
    # Prepare
    meta = {"kind": "join", "nested": {"list": [1, 2.5, None, True, "é"]}, "nan": float("inf")}
    payload = Payload(meta=meta)

    # Execute
    decoded = decode_chunks(encode_chunks(payload, chunk_bytes=1 << 20), max_message_bytes=0)

    # Assert
    assert decoded.meta == meta
    assert decoded.tensors == {}


@pytest.mark.parametrize("chunk_bytes", [1, 2, 7, 64, 1 << 20])
def test_codec_round_trip_chunk_sizes(chunk_bytes: int) -> None:
    # Prepare
    payload = Payload(
        meta={"round": 1},
        tensors={"w": np.arange(100, dtype=np.float32), "b": np.arange(3, dtype=np.int64)},
    )

    # Execute
    chunks = list(encode_chunks(payload, chunk_bytes=chunk_bytes))
    decoded = decode_chunks(chunks, max_message_bytes=LIMIT)

    # Assert
    assert all(0 < len(chunk) <= chunk_bytes for chunk in chunks)
    assert all(len(chunk) == chunk_bytes for chunk in chunks[:-1])
    _assert_same_payload(decoded, payload)


def test_codec_encode_first_chunk_carries_header_and_body() -> None:
    # Prepare
    payload = Payload(meta={}, tensors={"w": np.ones(1000, dtype=np.float32)})

    # Execute
    chunks = list(encode_chunks(payload, chunk_bytes=1024))

    # Assert
    header_length = struct.unpack("<I", chunks[0][4:8])[0]
    header = json.loads(chunks[0][8 : 8 + header_length])
    assert chunks[0][:4] == b"FCM1"
    assert header["body_bytes"] == 4000
    assert header["tensors"] == [
        {"name": "w", "dtype": "float32", "shape": [1000], "offset": 0, "nbytes": 4000}
    ]
    assert len(chunks[0]) == 1024


def test_codec_encode_converts_big_endian_and_non_contiguous() -> None:
    # Prepare
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    payload = Payload(
        tensors={
            "big": np.arange(6, dtype=">i4"),
            "strided": base[:, ::2],
            "fortran": np.asfortranarray(base),
        }
    )

    # Execute
    decoded = decode_chunks(encode_chunks(payload, chunk_bytes=11), max_message_bytes=LIMIT)

    # Assert
    np.testing.assert_array_equal(decoded.tensors["big"], np.arange(6))
    assert decoded.tensors["big"].dtype == np.dtype("<i4")
    np.testing.assert_array_equal(decoded.tensors["strided"], base[:, ::2])
    np.testing.assert_array_equal(decoded.tensors["fortran"], base)


def test_codec_decode_arrays_writable() -> None:
    # Prepare
    payload = Payload(tensors={"w": np.zeros(4, dtype=np.float32)})

    # Execute
    decoded = decode_chunks(encode_chunks(payload, chunk_bytes=8), max_message_bytes=LIMIT)
    decoded.tensors["w"][0] = 1.0

    # Assert
    assert decoded.tensors["w"].flags.writeable
    assert decoded.tensors["w"][0] == 1.0


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    arrays=st.lists(
        hnp.arrays(
            dtype=st.sampled_from(ALLOWED_DTYPES).map(np.dtype),
            shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5),
        ),
        max_size=5,
    ),
    meta=st.dictionaries(
        st.text(max_size=5), st.one_of(st.integers(), st.text(max_size=5), st.none()), max_size=3
    ),
    chunk_bytes=st.integers(min_value=1, max_value=600),
)
def test_codec_round_trip_random_payloads(
    arrays: list[np.ndarray], meta: dict[str, Any], chunk_bytes: int
) -> None:
    # Prepare
    payload = Payload(meta=meta, tensors={f"t{i}": array for i, array in enumerate(arrays)})

    # Execute
    chunks = list(encode_chunks(payload, chunk_bytes=chunk_bytes))
    decoded = decode_chunks(chunks, max_message_bytes=LIMIT)

    # Assert
    assert all(len(chunk) <= chunk_bytes for chunk in chunks)
    _assert_same_payload(decoded, payload)


def test_codec_decode_header_split_across_chunks() -> None:
    # Prepare
    payload = Payload(meta={"note": "x" * 50}, tensors={"w": np.arange(5, dtype=np.int32)})
    message = _encode(payload)
    cuts = [0, 2, 6, 20, 40, len(message) - 3, len(message)]
    decoder = PayloadDecoder(max_message_bytes=LIMIT)

    # Execute
    for start, end in itertools.pairwise(cuts):
        decoder.feed(message[start:end])
    decoded = decoder.finish()

    # Assert
    _assert_same_payload(decoded, payload)


def test_codec_decode_empty_chunks_ignored() -> None:
    # Prepare
    payload = Payload(tensors={"w": np.arange(3, dtype=np.float16)})
    message = _encode(payload)
    decoder = PayloadDecoder(max_message_bytes=LIMIT)

    # Execute
    for chunk in (b"", message[:10], b"", message[10:], b""):
        decoder.feed(chunk)
    decoded = decoder.finish()

    # Assert
    _assert_same_payload(decoded, payload)


@pytest.mark.parametrize("case", sorted(REJECTED_MESSAGES))
def test_codec_decode_rejects_malformed(case: str) -> None:
    # Prepare
    message, fragment = REJECTED_MESSAGES[case]
    decoder = PayloadDecoder(max_message_bytes=LIMIT)

    # Execute
    with pytest.raises(MessageRejected) as caught:
        decoder.feed(message)
        decoder.finish()

    # Assert
    assert fragment in str(caught.value)
    assert str(caught.value).endswith(".")


@pytest.mark.parametrize("case", sorted(REJECTED_MESSAGES))
def test_codec_decode_rejects_malformed_byte_by_byte(case: str) -> None:
    # Prepare
    message, _ = REJECTED_MESSAGES[case]
    decoder = PayloadDecoder(max_message_bytes=LIMIT)

    # Execute / Assert
    with pytest.raises(MessageRejected):
        for index in range(len(message)):
            decoder.feed(message[index : index + 1])
        decoder.finish()


def test_codec_decode_header_over_custom_limit() -> None:
    # Prepare
    message = _encode(Payload(meta={"note": "x" * 100}))
    decoder = PayloadDecoder(max_message_bytes=LIMIT, max_header_bytes=64)

    # Execute / Assert
    with pytest.raises(MessageRejected, match="over the limit of 64 bytes"):
        decoder.feed(message[:8])


def test_codec_decode_oversized_rejected_before_buffering() -> None:
    # Prepare
    size = 1 << 50
    header = {
        "meta": {},
        "tensors": [{"name": "w", "dtype": "uint8", "shape": [size], "offset": 0, "nbytes": size}],
        "body_bytes": size,
    }
    first_chunk = _message(header, b"\x00" * 16)
    decoder = PayloadDecoder(max_message_bytes=1 << 30)

    # Execute / Assert
    with pytest.raises(MessageRejected, match="over the limit of 1073741824 bytes"):
        decoder.feed(first_chunk)


def test_codec_decode_oversized_encoded_payload_rejected_on_first_chunk() -> None:
    # Prepare
    payload = Payload(tensors={"w": np.zeros(4096, dtype=np.float32)})
    first_chunk = next(encode_chunks(payload, chunk_bytes=256))
    decoder = PayloadDecoder(max_message_bytes=1024)

    # Execute / Assert
    with pytest.raises(MessageRejected, match="16384 bytes, over the limit of 1024"):
        decoder.feed(first_chunk)


def test_codec_decode_truncated_body_at_finish() -> None:
    # Prepare
    message = _encode(Payload(tensors={"w": np.arange(10, dtype=np.float32)}))
    decoder = PayloadDecoder(max_message_bytes=LIMIT)
    decoder.feed(message[:-1])

    # Execute / Assert
    with pytest.raises(MessageRejected, match=r"truncated.*40 body bytes but only 39"):
        decoder.finish()


@pytest.mark.parametrize("length", [0, 3, 8, 12])
def test_codec_decode_truncated_header_at_finish(length: int) -> None:
    # Prepare
    message = _encode(Payload(meta={"round": 1}))
    decoder = PayloadDecoder(max_message_bytes=LIMIT)
    decoder.feed(message[:length])

    # Execute / Assert
    with pytest.raises(MessageRejected, match="truncated"):
        decoder.finish()


def test_codec_decoder_single_use() -> None:
    # Prepare
    message = _encode(Payload(meta={"round": 1}))
    decoder = PayloadDecoder(max_message_bytes=LIMIT)
    decoder.feed(message)
    decoder.finish()

    # Execute / Assert
    with pytest.raises(TransportError, match="new decoder"):
        decoder.feed(message)


def test_codec_decoder_refuses_feed_after_rejection() -> None:
    # Prepare
    decoder = PayloadDecoder(max_message_bytes=LIMIT)
    with pytest.raises(MessageRejected):
        decoder.feed(b"NOPE")

    # Execute / Assert
    with pytest.raises(TransportError, match="new decoder"):
        decoder.feed(b"FCM1")


@pytest.mark.parametrize(
    ("array", "fragment"),
    [
        (np.array([1 + 2j]), "complex128"),
        (np.array([object()], dtype=object), "object"),
        (np.array(["a"]), "<U1"),
        (np.zeros(2, dtype=[("x", "<f4")]), "[('x', '<f4')]"),
        (np.array(["2024-01-01"], dtype="datetime64[D]"), "datetime64"),
        ([1.0, 2.0], "list"),
    ],
)
def test_codec_encode_rejects_bad_tensor(array: Any, fragment: str) -> None:
    # Prepare
    payload = Payload(tensors={"bad.tensor": array})

    # Execute / Assert
    with pytest.raises(TransportError, match=r"'bad\.tensor'") as caught:
        list(encode_chunks(payload, chunk_bytes=1024))
    assert fragment in str(caught.value)


@pytest.mark.parametrize(
    "meta",
    [
        {"bad_key": np.float32(1.0)},
        {"bad_key": {1: "x"}},
        {"bad_key": [1, {"deep": {1, 2}}]},
        {"bad_key": b"bytes"},
    ],
)
def test_codec_encode_rejects_unserialisable_meta(meta: dict[str, Any]) -> None:
    # Prepare
    payload = Payload(meta=meta)

    # Execute / Assert
    with pytest.raises(TransportError, match="'bad_key'"):
        encode_chunks(payload, chunk_bytes=1024)


@pytest.mark.parametrize("name", ["", "n" * 257, 3])
def test_codec_encode_rejects_bad_tensor_name(name: Any) -> None:
    # Prepare
    payload = Payload(tensors={name: np.zeros(1)})

    # Execute / Assert
    with pytest.raises(TransportError, match="Tensor name"):
        encode_chunks(payload, chunk_bytes=1024)


@pytest.mark.parametrize("chunk_bytes", [0, -1, True, 1.5])
def test_codec_encode_rejects_bad_chunk_bytes(chunk_bytes: Any) -> None:
    # Prepare
    payload = Payload(meta={"round": 1})

    # Execute / Assert
    with pytest.raises(ValueError, match="chunk_bytes"):
        encode_chunks(payload, chunk_bytes=chunk_bytes)


def test_codec_encode_accepts_longest_tensor_name() -> None:
    # Prepare
    payload = Payload(tensors={"n" * 256: np.ones(2, dtype=np.int8)})

    # Execute
    decoded = decode_chunks(encode_chunks(payload, chunk_bytes=100), max_message_bytes=LIMIT)

    # Assert
    _assert_same_payload(decoded, payload)


# ------------------------------------------------- hostile input: fuzzing and reservations


def _feed_all(decoder: PayloadDecoder, chunks: list[bytes]) -> Payload | None:
    """Feeds ``chunks``; returns the payload, or None when the decoder refused the bytes.

    After every chunk the decoder may hold no more than what it was fed.
    """
    fed = 0
    try:
        for chunk in chunks:
            decoder.feed(chunk)
            fed += len(chunk)
            assert decoder.buffered <= fed
        return decoder.finish()
    except MessageRejected:
        return None


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(cut, len(data)) for cut in cuts})
    bounds = [0, *points, len(data)]
    return [data[start:end] for start, end in itertools.pairwise(bounds)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.binary(max_size=512),
    cuts=st.lists(st.integers(min_value=0, max_value=512), max_size=8),
    prefix=st.booleans(),
)
def test_codec_decoder_fuzz_arbitrary_bytes_only_rejects(
    data: bytes, cuts: list[int], prefix: bool
) -> None:
    # Prepare: random bytes, half of them behind a valid magic and a plausible header length
    raw = (b"FCM1" + struct.pack("<I", len(data) // 2) + data) if prefix else data
    decoder = PayloadDecoder(max_message_bytes=LIMIT, max_header_bytes=4096)

    # Execute
    result = _feed_all(decoder, _split(raw, cuts))

    # Assert: either a refusal (MessageRejected, nothing else) or a payload that re-encodes to
    # exactly the bytes that were fed
    if result is not None:
        assert _encode(result) == raw


@settings(max_examples=300, deadline=None)
@given(
    position=st.integers(min_value=0, max_value=10_000),
    value=st.integers(min_value=0, max_value=255),
    cut=st.integers(min_value=0, max_value=10_000),
    mode=st.sampled_from(["flip", "truncate", "extend"]),
    chunk=st.integers(min_value=1, max_value=64),
)
def test_codec_decoder_fuzz_mutated_message_only_rejects(
    position: int, value: int, cut: int, mode: str, chunk: int
) -> None:
    # Prepare: a valid message, then one byte changed, a tail cut off, or bytes appended
    payload = Payload(
        meta={"round": 3, "kind": "upload"},
        tensors={"w": np.arange(12, dtype=np.float32).reshape(3, 4), "n": np.array(7)},
    )
    message = bytearray(_encode(payload))
    if mode == "flip":
        message[position % len(message)] = value
    elif mode == "truncate":
        del message[cut % len(message) :]
    else:
        message += bytes([value]) * (1 + cut % 16)
    chunks = [bytes(message[i : i + chunk]) for i in range(0, len(message), chunk)]
    decoder = PayloadDecoder(max_message_bytes=LIMIT)

    # Execute
    result = _feed_all(decoder, chunks)

    # Assert
    if mode != "flip":
        assert result is None  # a cut or a longer message is always refused
    elif result is not None:
        assert _encode(result) == bytes(message)


def test_codec_decoder_reserves_nothing_before_the_body_arrives() -> None:
    # Prepare: a header that announces 512 MiB (within the limit), followed by 16 bytes only
    size = 512 << 20
    header = {
        "meta": {},
        "tensors": [{"name": "w", "dtype": "uint8", "shape": [size], "offset": 0, "nbytes": size}],
        "body_bytes": size,
    }
    decoder = PayloadDecoder(max_message_bytes=1 << 30)
    tracemalloc.start()
    try:
        # Execute
        decoder.feed(_message(header, b"\x01" * 16))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    # Assert: the decoder holds what arrived, not what was announced
    assert not decoder.complete
    assert decoder.buffered == 16
    assert peak < 1 << 20
    with pytest.raises(MessageRejected, match=f"announced {size} body bytes but only 16"):
        decoder.finish()


def test_codec_decoder_grows_its_body_as_chunks_arrive() -> None:
    # Prepare
    payload = Payload(tensors={"w": np.arange(4096, dtype=np.float64)})
    chunks = list(encode_chunks(payload, chunk_bytes=4096))
    decoder = PayloadDecoder(max_message_bytes=LIMIT)
    held = []

    # Execute
    for chunk in chunks:
        decoder.feed(chunk)
        held.append(decoder.buffered)
    decoded = decoder.finish()

    # Assert: the body grows by one chunk at a time up to the announced 32768 bytes
    assert held[-1] == 32768
    assert all(later > earlier for earlier, later in itertools.pairwise(held[1:]))
    assert np.array_equal(decoded.tensors["w"], payload.tensors["w"])
    decoded.tensors["w"][0] = -1.0  # writable
    assert decoded.tensors["w"][0] == -1.0


def test_codec_decoder_lands_the_body_in_the_bytes_of_an_earlier_message() -> None:
    # Prepare: two messages of one layout; the first decoded as usual, its owner done with it
    first = Payload(meta={"round": 1}, tensors={"a": np.arange(700.0), "b": np.ones((9, 4))})
    second = Payload(meta={"round": 2}, tensors={"a": -np.arange(700.0), "b": np.zeros((9, 4))})
    one = PayloadDecoder(max_message_bytes=LIMIT)
    for chunk in encode_chunks(first, chunk_bytes=1000):
        one.feed(chunk)
    old = one.finish()
    spare = one.body
    chunks = list(encode_chunks(second, chunk_bytes=1000))
    two = PayloadDecoder(max_message_bytes=LIMIT)

    # Execute: the header and the body's first bytes arrive, then the rest lands in the spare
    two.feed(chunks[0])
    assert two.layout == one.layout
    landed = two.land_in(spare)
    for chunk in chunks[1:]:
        two.feed(chunk)
    new = two.finish()

    # Assert: the second message is exact, in the spare's very bytes (no body of its own)
    assert landed and two.body is spare
    for name, array in second.tensors.items():
        np.testing.assert_array_equal(new.tensors[name], array)
        assert np.shares_memory(new.tensors[name], old.tensors[name])
    assert new.meta == {"round": 2}


def test_codec_decoder_lands_only_in_a_buffer_of_the_body_size_while_it_arrives() -> None:
    payload = Payload(tensors={"w": np.arange(512, dtype=np.float32)})
    chunks = list(encode_chunks(payload, chunk_bytes=256))
    decoder = PayloadDecoder(max_message_bytes=LIMIT)
    assert not decoder.land_in(bytearray(2048))  # no header yet
    decoder.feed(chunks[0])
    assert not decoder.land_in(bytearray(2047))  # not the body's size
    assert decoder.land_in(bytearray(2048))
    assert not decoder.land_in(bytearray(2048))  # once
    for chunk in chunks[1:]:
        decoder.feed(chunk)
    assert not decoder.land_in(bytearray(2048))  # complete
    np.testing.assert_array_equal(decoder.finish().tensors["w"], payload.tensors["w"])
    longer = PayloadDecoder(max_message_bytes=LIMIT)
    longer.feed(chunks[0])
    longer.land_in(bytearray(2048))
    with pytest.raises(MessageRejected, match="longer than announced"):
        for chunk in [*chunks[1:], b"\x00"]:
            longer.feed(chunk)


def test_unviewed_says_whether_any_array_or_view_still_holds_the_bytes() -> None:
    payload = Payload(tensors={"w": np.arange(64, dtype=np.float32)})
    decoder = PayloadDecoder(max_message_bytes=LIMIT)
    for chunk in encode_chunks(payload, chunk_bytes=64):
        decoder.feed(chunk)
    decoded = decoder.finish()
    body = decoder.body
    view = decoded.tensors["w"][3:9]
    del decoded
    assert not unviewed(body)  # a slice of a decoded array still views it
    del view
    assert unviewed(body) and len(body) == 256  # the probe leaves it as it was
    window = memoryview(body)
    assert not unviewed(body)
    window.release()
    assert unviewed(body)


def test_a_servers_spare_bytes_are_kept_only_unviewed_handed_out_once_and_dropped() -> None:
    from fedcore.transport._server import _Spare

    spare = _Spare()
    viewed = bytearray(100)
    array = np.frombuffer(viewed, dtype=np.uint8)
    spare.keep(viewed)
    assert spare.take(100) is None  # an array still views it: not kept
    del array
    free = bytearray(100)
    spare.keep(free)
    assert spare.take(99) is None  # only for a body of its size
    assert spare.take(100) is free
    assert spare.take(100) is None  # once
    spare.keep(free)
    spare.drop()
    spare.keep(free)  # let go of just after a drop: not kept through what follows it
    assert spare.take(100) is None  # (a large message arrives: keeping again)
    spare.keep(free)
    assert spare.take(100) is free
