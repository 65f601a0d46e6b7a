"""The two forms of an RPC call (unary for a one-chunk request, else a stream), over real TLS."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from fedcore.transport import (
    CallContext,
    Identity,
    Limits,
    Payload,
    RpcClient,
    RpcServer,
    TlsBundle,
    encode_chunks,
    issue_run_bundles,
)

pytestmark = pytest.mark.integration

SERVICE = "Forms"
LIMITS = Limits(chunk_bytes=64 * 1024, max_message_bytes=32 << 20)
TIMEOUT = 30.0


class Counting:
    """Handlers that count their calls: a small answer, and one of ``meta.values`` floats."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def small(self, peer: Identity, request: Payload, context: CallContext) -> Payload:
        self.calls.append("Small")
        return Payload(meta={"caller": peer.common_name, "echo": request.meta})

    def large(self, peer: Identity, request: Payload, context: CallContext) -> Payload:
        self.calls.append("Large")
        count = int(request.meta["values"])
        return Payload(meta={"n": count}, tensors={"x": np.arange(count, dtype=np.float64)})


@pytest.fixture(scope="module")
def bundles() -> dict[str, TlsBundle]:
    return issue_run_bundles("forms", num_clients=1)[1]


@pytest.fixture
def served(bundles: dict[str, TlsBundle]) -> Iterator[tuple[RpcClient, Counting, list]]:
    handlers = Counting()
    transferred: list[tuple[int, int]] = []
    server = RpcServer(
        "127.0.0.1:0",
        bundles["server"],
        {"Small": handlers.small, "Large": handlers.large},
        service=SERVICE,
        limits=LIMITS,
        max_workers=4,
        on_bytes=lambda sent, received: transferred.append((sent, received)),
    )
    server.start()
    client = RpcClient(
        f"127.0.0.1:{server.port}",
        bundles["client-0"],
        service=SERVICE,
        limits=LIMITS,
        peer=Identity("server"),
    )
    try:
        yield client, handlers, transferred
    finally:
        client.close()
        server.stop(grace=0)


def test_one_chunk_call_is_answered_in_the_unary_form(served, bundles) -> None:
    # Prepare
    client, handlers, _ = served
    request = Payload(meta={"round": 3})
    raw = b"".join(encode_chunks(request, chunk_bytes=LIMITS.chunk_bytes))
    bundle = bundles["client-0"]
    channel = grpc.secure_channel(
        client._target,
        grpc.ssl_channel_credentials(
            root_certificates=bundle.ca_pem,
            private_key=bundle.key_pem,
            certificate_chain=bundle.cert_pem,
        ),
        options=[("grpc.ssl_target_name_override", "server.fedcore.invalid")],
    )
    # Execute
    try:
        answer = client.call("Small", request, timeout=TIMEOUT)
        unary = channel.unary_unary(f"/fedcore.v1.{SERVICE}.Unary/Small")(raw, timeout=TIMEOUT)
    finally:
        channel.close()
    # Assert
    assert answer.meta == {"caller": "client-0", "echo": {"round": 3}}
    assert unary.startswith(b"FCM1")
    assert handlers.calls == ["Small", "Small"]


@pytest.mark.parametrize("values", [10, 100_000])
def test_a_response_over_one_chunk_comes_whole_and_the_handler_runs_once(
    served, values: int
) -> None:
    # Prepare: 100,000 float64 are 800 kB, thirteen 64 KiB chunks.
    client, handlers, transferred = served
    # Execute
    answer = client.call("Large", Payload(meta={"values": values}), timeout=TIMEOUT)
    again = client.call("Large", Payload(meta={"values": values}), timeout=TIMEOUT)
    # Assert
    for got in (answer, again):
        np.testing.assert_array_equal(got.tensors["x"], np.arange(values, dtype=np.float64))
    assert handlers.calls == ["Large", "Large"]
    assert sum(sent for sent, _ in transferred) > 2 * values * 8
    assert client._stream_only == set()


def test_a_large_request_goes_in_the_stream_form(served) -> None:
    # Prepare
    client, handlers, _ = served
    big = np.ones(50_000)
    # Execute
    answer = client.call("Small", Payload(meta={"a": 1}, tensors={"big": big}), timeout=TIMEOUT)
    # Assert
    assert answer.meta == {"caller": "client-0", "echo": {"a": 1}}
    assert handlers.calls == ["Small"]
