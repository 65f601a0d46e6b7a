"""Moving Payloads between roles: the chunked wire codec and the per-run mutual-TLS PKI."""

from fedcore.transport._codec import PayloadDecoder, decode_chunks, encode_chunks
from fedcore.transport._payload import Payload
from fedcore.transport._rpc import (
    CallContext,
    Limits,
    RemoteError,
    RetryPolicy,
    RpcClient,
    RpcServer,
)
from fedcore.transport._tls import Identity, RunCa, TlsBundle, issue_run_bundles

__all__ = [
    "CallContext",
    "Limits",
    "RemoteError",
    "RetryPolicy",
    "RpcClient",
    "RpcServer",
    "Identity",
    "Payload",
    "PayloadDecoder",
    "RunCa",
    "TlsBundle",
    "decode_chunks",
    "encode_chunks",
    "issue_run_bundles",
]
