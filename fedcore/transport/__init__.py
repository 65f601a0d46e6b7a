"""Moving Payloads between roles: the chunked wire codec, the per-run mutual-TLS PKI, and a
hub's one endpoint (routing by TLS server name, relays for parties that only dial out)."""

from fedcore.transport._aio import AsyncClientSession, AsyncRpcClient, Turn
from fedcore.transport._codec import PayloadDecoder, decode_chunks, encode_chunks
from fedcore.transport._payload import PackedTensors, Payload
from fedcore.transport._revocations import RevokedSites
from fedcore.transport._router import (
    ConnectionHandler,
    SniRouter,
    TunnelBroker,
    dial,
    forward_to,
    splice,
)
from fedcore.transport._rpc import (
    ClientSession,
    Limits,
    RemoteError,
    RetryPolicy,
    RpcClient,
)
from fedcore.transport._server import CallContext, RpcServer, ServerSession, SessionHandler
from fedcore.transport._tls import (
    Identity,
    RunCa,
    TlsBundle,
    certificate_facts,
    fingerprint,
    issue_run_bundles,
    new_key_and_request,
)

__all__ = [
    "AsyncClientSession",
    "AsyncRpcClient",
    "CallContext",
    "ClientSession",
    "ConnectionHandler",
    "Identity",
    "Limits",
    "PackedTensors",
    "Payload",
    "PayloadDecoder",
    "RemoteError",
    "RetryPolicy",
    "RevokedSites",
    "RpcClient",
    "RpcServer",
    "RunCa",
    "ServerSession",
    "SessionHandler",
    "SniRouter",
    "TlsBundle",
    "TunnelBroker",
    "Turn",
    "certificate_facts",
    "decode_chunks",
    "dial",
    "encode_chunks",
    "fingerprint",
    "forward_to",
    "issue_run_bundles",
    "new_key_and_request",
    "splice",
]
