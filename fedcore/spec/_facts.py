"""Facts about each protocol that the runner, the operator and validation need without torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DropoutPolicy = Literal["Skip", "Redo", "Fail"]
"""What the server does when a sampled client does not upload in time.

Skip: aggregate the uploads that arrived when the quorum is met (plain averaging is still right).
Redo: run the round again without the missing clients (masks that must cancel would not).
Fail: stop the run (no safe way to continue).
"""


@dataclass(frozen=True)
class ProtocolFacts:
    """What a protocol needs from the runtime.

    Attributes:
        name: the protocol's name in ``spec.protocol.name``.
        needs_kdc: whether a KDC role must run (and be ready before the server).
        decentralized: whether clients talk to each other over peer links.
        claims_dp: whether the protocol claims differential privacy (may take a budget).
        dropout_policy: what the server does when a sampled client does not upload.
        summary: one line for docs and ``fedcore validate``.
        server_uses_kdc: whether the server also calls the KDC (for its own keys); the runner
            and the operator then give the server the KDC's address.
        clients_hold_model: whether clients receive the true global model (or models) in
            their tasks, so that they may score it on their own data
            (``spec.data.evaluation.where`` Clients); false where they only ever see a
            perturbed one.
        secure_aggregation: whether the server learns only the sum of the clients' updates
            (secure aggregation). False for every protocol fedcore has: each server sees the
            individual updates or their encodings (a site's policy may require it:
            ``fedcore.sites.policy``).
        compressible: which messages (``uploads``, ``broadcasts``) may be compressed
            (``spec.transport.compression``); the others must travel exactly.
        exact_because: why the others must be exact (the refusal's reason).
    """

    name: str
    needs_kdc: bool
    decentralized: bool
    claims_dp: bool
    dropout_policy: DropoutPolicy
    summary: str
    server_uses_kdc: bool = False
    clients_hold_model: bool = True
    secure_aggregation: bool = False
    compressible: tuple[str, ...] = ()
    exact_because: str = ""


PROTOCOL_FACTS: dict[str, ProtocolFacts] = {
    facts.name: facts
    for facts in (
        ProtocolFacts(
            name="fedavg",
            needs_kdc=False,
            decentralized=False,
            claims_dp=False,
            dropout_policy="Skip",
            summary="Federated averaging: local epochs, model mean weighted by shard size.",
            compressible=("uploads", "broadcasts"),
        ),
        ProtocolFacts(
            name="dp-fedavg",
            needs_kdc=False,
            decentralized=False,
            claims_dp=True,
            dropout_policy="Skip",
            summary="FedAvg with per-client update clipping and central Gaussian noise.",
            compressible=("uploads", "broadcasts"),  # the server clips what arrives
        ),
        ProtocolFacts(
            name="perturb",
            needs_kdc=False,
            decentralized=False,
            claims_dp=False,
            dropout_policy="Skip",
            summary="Accuracy-lossless model perturbation: clients train on a secretly "
            "perturbed model; the server recovers the exact FedSGD gradient (seed 001).",
            clients_hold_model=False,
            compressible=(),
            exact_because=(
                "the server's model is perturbed by secrets that only exact arithmetic undoes "
                "(accuracy-lossless perturbation)"
            ),
        ),
        ProtocolFacts(
            name="mpdp",
            needs_kdc=True,
            decentralized=False,
            claims_dp=True,
            dropout_policy="Redo",
            summary="MP_Server model perturbation plus DDP_Client noise with pairwise masks "
            "agreed over the KDC (seed 000).",
            clients_hold_model=False,
            compressible=(),
            exact_because="the pairwise masks cancel in the sum only when every upload is exact",
        ),
        ProtocolFacts(
            name="lppa",
            needs_kdc=False,
            decentralized=True,
            claims_dp=False,
            dropout_policy="Fail",
            summary="Gradient tracking (DSGT) over a peer graph whose trackers start with "
            "zero-sum noise exchanged between neighbours; the server only paces rounds and "
            "gathers scalar metrics (seed 002).",
            compressible=(),
            exact_because=(
                "its clients exchange states with each other, not with the server, and its "
                "trackers' noise cancels only exactly"
            ),
        ),
        ProtocolFacts(
            name="adaptive",
            needs_kdc=False,
            decentralized=False,
            claims_dp=False,
            dropout_policy="Skip",
            summary="FedSGD where each client adds a distortion learned under a PL or DP "
            "budget, or the static Identical baseline (seed 003).",
            compressible=("uploads", "broadcasts"),  # rounding a distorted upload after
            # the fact is post-processing: the measure it claims still holds
        ),
        ProtocolFacts(
            name="ebscfl",
            needs_kdc=True,
            decentralized=False,
            claims_dp=False,
            dropout_policy="Redo",
            summary="Secure clustered FL: clients encode unit updates into a hidden cluster's "
            "slot with KDC keys; the server filters negatively correlated updates and verifies "
            "encodings under encoding, decoding only weighted per-cluster sums (seed 004).",
            server_uses_kdc=True,
            compressible=(),
            exact_because="the encodings are decoded by exact linear algebra on the server",
        ),
        ProtocolFacts(
            name="secagg",
            needs_kdc=False,
            decentralized=False,
            claims_dp=True,  # with spec.protocol.secagg.distributedDp; none without
            dropout_policy="Skip",
            summary="SecAgg+ (Bell et al. 2020): clients mask their quantized updates with "
            "pairwise and self masks whose seeds are Shamir-shared on a sparse graph; the "
            "server learns only the sum of the survivors' updates, whoever drops out.",
            secure_aggregation=True,
            compressible=(),
            exact_because="the masks cancel in the sum only when every masked input is exact",
        ),
        ProtocolFacts(
            name="fedsgd",
            needs_kdc=False,
            decentralized=False,
            claims_dp=False,
            dropout_policy="Skip",
            summary="Federated SGD: one full-shard gradient per client, one server step.",
            compressible=("uploads", "broadcasts"),
        ),
    )
}


def protocol_facts(name: str) -> ProtocolFacts:
    """Returns the facts of protocol ``name``.

    Raises:
        KeyError: if no protocol has that name.
    """
    try:
        return PROTOCOL_FACTS[name]
    except KeyError:
        known = ", ".join(sorted(PROTOCOL_FACTS))
        raise KeyError(f"Unknown protocol {name!r}; known protocols: {known}.") from None


RESUME_INSENSITIVE_FIELDS = (
    "rounds",
    "checkpoint",
    "roles",
    "failurePolicy",
    "evaluation",
    "transport",
    "suspend",
    "activeDeadlineSeconds",
    "backoffLimit",
)
"""Spec fields a resumed run may change; every other field must match its checkpoint (the
fingerprint leaves them out, and a suspended run on Kubernetes may change them)."""
