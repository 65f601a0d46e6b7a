"""Moving Payloads between roles: the chunked wire codec and the per-run mutual-TLS PKI."""

from fedcore.transport._codec import PayloadDecoder, decode_chunks, encode_chunks
from fedcore.transport._payload import Payload
from fedcore.transport._rpc import (
    CallContext,
    ClientSession,
    Limits,
    RemoteError,
    RetryPolicy,
    RpcClient,
    RpcServer,
    ServerSession,
    SessionHandler,
)
from fedcore.transport._tls import Identity, RunCa, TlsBundle, issue_run_bundles

__all__ = [
    "CallContext",
    "ClientSession",
    "Identity",
    "Limits",
    "Payload",
    "PayloadDecoder",
    "RemoteError",
    "RetryPolicy",
    "RpcClient",
    "RpcServer",
    "RunCa",
    "ServerSession",
    "SessionHandler",
    "TlsBundle",
    "decode_chunks",
    "encode_chunks",
    "issue_run_bundles",
]
