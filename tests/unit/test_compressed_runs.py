"""A run's compression (fedcore/protocols/_compressed.py): the aggregate's error, what the spec
refuses, and what a receiver refuses of another party's compressed message."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import yaml

from fedcore.errors import MessageRejected, SpecError
from fedcore.protocols._compressed import compress_tensors, decompress_tensors
from fedcore.simulation import Observer, simulate
from fedcore.spec import load_manifest
from fedcore.transport import Payload

BASE: dict[str, Any] = {
    "apiVersion": "fedcore.dev/v1alpha1",
    "kind": "FederatedRun",
    "metadata": {"name": "unit"},
    "spec": {
        "protocol": {"name": "fedavg"},
        "model": {"kind": "MLP", "hidden": [16]},
        "data": {"source": {"kind": "Digits"}},
        "clients": {"count": 4},
        "rounds": 1,
        "training": {"batchSize": 32, "optimizer": {"kind": "SGD", "learningRate": 0.1}},
        "seed": 5,
    },
}


def manifest(protocol: str = "fedavg", **compression: str) -> Any:
    document = yaml.safe_load(yaml.safe_dump(BASE))
    document["spec"]["protocol"] = {"name": protocol}
    if compression:
        document["spec"]["transport"] = {"compression": compression}
    return load_manifest("unit", text=yaml.safe_dump(document))


class Uploads(Observer):
    """Keeps each client's upload as the server received it."""

    def __init__(self) -> None:
        self.seen: dict[int, Payload] = {}

    def on_upload(self, round: int, client: int, upload: Payload) -> None:
        self.seen[client] = upload


def test_an_int8_round_lands_within_the_uploads_stated_error_of_the_exact_round() -> None:
    # Prepare: the same first round exact and with Int8 uploads (the broadcast is exact, so
    # every client trains the same model in both and uploads the same values)
    exact_uploads, int8_uploads = Uploads(), Uploads()
    exact = simulate(manifest(), observer=exact_uploads).weights
    int8 = simulate(manifest(uploads="Int8"), observer=int8_uploads).weights

    # Execute: each upload's error is at most its tensor's largest magnitude / 254, so the
    # shard-weighted mean's is at most the weighted mean of those
    sizes = {k: u.meta["num_examples"] for k, u in exact_uploads.seen.items()}
    total = sum(sizes.values())

    # Assert
    for name, value in exact.items():
        bound = sum(
            sizes[k] / total * float(np.abs(u.tensors[name]).max()) / 254
            for k, u in exact_uploads.seen.items()
        )
        error = np.abs(int8[name].astype(np.float64) - value.astype(np.float64))
        assert error.max() <= bound * (1 + 1e-6) + 1e-7, name
    # the server saw rounded uploads, not the exact ones (the test can fail)
    assert any(
        not np.array_equal(int8_uploads.seen[k].tensors[n], exact_uploads.seen[k].tensors[n])
        for k in sizes
        for n in exact
    )


@pytest.mark.parametrize("protocol", ["mpdp", "perturb", "ebscfl", "lppa"])
@pytest.mark.parametrize("direction", ["uploads", "broadcasts"])
def test_protocols_whose_maths_needs_exact_values_refuse_compression_naming_the_field(
    protocol: str, direction: str
) -> None:
    with pytest.raises(SpecError) as caught:
        manifest(protocol, **{direction: "Float16"})
    message = str(caught.value)
    assert f"spec.transport.compression.{direction}" in message
    assert f"protocol {protocol!r}" in message and "allowed here: 'None'" in message


@pytest.mark.parametrize("protocol", ["fedavg", "fedsgd", "dp-fedavg", "adaptive"])
def test_protocols_that_average_what_arrives_take_every_codec(protocol: str) -> None:
    run = manifest(protocol, uploads="Int8", broadcasts="BFloat16", rounding="Stochastic")
    assert run.spec.transport.compression.uploads == "Int8"


def test_a_compressed_upload_is_refused_where_the_spec_compresses_nothing() -> None:
    # Prepare: a client compresses although the run says None
    sender, receiver = manifest(uploads="Int8"), manifest()
    tensors, description = compress_tensors(
        sender.spec, "uploads", {"w": np.ones(8, np.float32)}, round=1, attempt=1
    )

    # Execute / Assert
    with pytest.raises(MessageRejected, match=r"compression.uploads is None"):
        decompress_tensors(receiver.spec, "uploads", tensors, description, what="upload")


def test_an_upload_compressed_with_another_codec_than_the_specs_is_refused() -> None:
    sender, receiver = manifest(uploads="Float16"), manifest(uploads="Int8")
    tensors, description = compress_tensors(
        sender.spec, "uploads", {"w": np.ones(8, np.float32)}, round=1, attempt=1
    )
    with pytest.raises(MessageRejected, match=r"'w' is compressed with 'Float16'.*'Int8'"):
        decompress_tensors(receiver.spec, "uploads", tensors, description, what="upload")


def test_an_exact_upload_is_taken_where_the_spec_compresses() -> None:
    # A client may always send exact values (say, a tensor that cannot be compressed).
    run = manifest(uploads="Int8")
    sent = {"w": np.arange(6, dtype=np.float32)}
    got = decompress_tensors(run.spec, "uploads", sent, None, what="upload")
    assert np.array_equal(got["w"], sent["w"])


def test_stochastic_rounding_is_reproducible_per_round_and_client_and_differs_across_them() -> None:
    run = manifest(uploads="Int8", rounding="Stochastic")
    values = {"w": np.random.default_rng(0).normal(size=256).astype(np.float32)}

    def sent(round_: int, client: int) -> np.ndarray:
        tensors, _ = compress_tensors(
            run.spec, "uploads", values, round=round_, attempt=1, client=client
        )
        return tensors["w"]

    assert np.array_equal(sent(1, 2), sent(1, 2))
    assert not np.array_equal(sent(1, 2), sent(1, 3))
    assert not np.array_equal(sent(1, 2), sent(2, 2))
