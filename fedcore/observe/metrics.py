"""Prometheus metrics of every role: ``fedcore_*`` names, base units, bounded labels.

Each role builds one ``RoleMetrics`` on its own registry and serves it on a local port; labels
are only ``run`` and ``role`` (plus small closed sets such as ``reason``), never a client index.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

import fedcore

ROUND_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)
REJECT_REASONS = (
    "malformed",
    "identity",
    "refused",
    "upload",
    "encoding",
    "bound",
    "evaluation",
    "stale",
    "revoked",
)
"""The closed set of ``reason`` values of ``fedcore_rejected_messages_total``."""


class RoleMetrics:
    """The metrics one role exports.

    Args:
        run: the run's name (a label on every series).
        role: ``server``, ``client`` or ``kdc`` (a label on every series).
    """

    def __init__(self, run: str, role: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["run", "role"]
        self._values = {"run": run, "role": role}
        r = self.registry
        self.build_info = Info("fedcore_build", "fedcore version of this process.", registry=r)
        self.build_info.info({"version": fedcore.__version__, "role": role, "run": run})
        self.rounds_completed = Counter(
            "fedcore_rounds_completed", "Rounds this role completed.", labels, registry=r
        ).labels(**self._values)
        self.round_duration = Histogram(
            "fedcore_round_duration_seconds",
            "Wall time of one round.",
            labels,
            buckets=ROUND_BUCKETS,
            registry=r,
        ).labels(**self._values)
        self.round = Gauge(
            "fedcore_round", "The last round this role completed.", labels, registry=r
        ).labels(**self._values)
        self.rounds_planned = Gauge(
            "fedcore_rounds_planned",
            "The rounds this run is to complete (spec.rounds; set by the server).",
            labels,
            registry=r,
        ).labels(**self._values)
        self.participants = Gauge(
            "fedcore_round_participants", "Uploads combined in the last round.", labels, registry=r
        ).labels(**self._values)
        self.dropouts = Counter(
            "fedcore_client_dropouts", "Planned uploads that did not arrive.", labels, registry=r
        ).labels(**self._values)
        self.redone_rounds = Counter(
            "fedcore_rounds_redone",
            "Rounds run again after missing their quorum.",
            labels,
            registry=r,
        ).labels(**self._values)
        self.bytes_sent = Counter(
            "fedcore_bytes_sent", "Bytes this role sent over gRPC.", labels, registry=r
        ).labels(**self._values)
        self.bytes_received = Counter(
            "fedcore_bytes_received", "Bytes this role received over gRPC.", labels, registry=r
        ).labels(**self._values)
        self._rejected = Counter(
            "fedcore_rejected_messages",
            "Inbound messages refused (reason: malformed, identity, refused, upload, encoding, "
            "bound, evaluation, stale).",
            [*labels, "reason"],
            registry=r,
        )
        self._rejected_by_sender = Counter(
            "fedcore_rejected_messages_by_sender",
            "Inbound messages refused, by the authenticated sender (a certificate's common "
            "name) and reason. A series exists only for a sender that was refused at least "
            "once, so it stays as small as the set of misbehaving parties.",
            [*labels, "sender", "reason"],
            registry=r,
        )
        if role != "client":  # only the server and the KDC accept inbound calls
            for reason in REJECT_REASONS:  # exported as 0 from the start, so rates have data
                self._rejected.labels(**self._values, reason=reason)
        self.accuracy = Gauge(
            "fedcore_model_accuracy",
            "Held-out accuracy of the global model (0 to 1).",
            labels,
            registry=r,
        ).labels(**self._values)
        self.loss = Gauge(
            "fedcore_model_loss", "Held-out loss of the global model.", labels, registry=r
        ).labels(**self._values)
        self.epsilon = Gauge(
            "fedcore_privacy_epsilon",
            "Epsilon spent so far (at the run's delta).",
            labels,
            registry=r,
        ).labels(**self._values)
        self.epsilon_budget = Gauge(
            "fedcore_privacy_epsilon_budget",
            "The run's epsilon budget (spec.privacy).",
            labels,
            registry=r,
        ).labels(**self._values)
        self.checkpoint_duration = Histogram(
            "fedcore_checkpoint_duration_seconds",
            "Time to write one checkpoint.",
            labels,
            registry=r,
        ).labels(**self._values)
        self.checkpoint_failures = Counter(
            "fedcore_checkpoint_failures",
            "Failed checkpoint store attempts (every retried S3 request counts once) and "
            "checkpoints that failed for good.",
            labels,
            registry=r,
        ).labels(**self._values)

    def rejected(self, reason: str, sender: str | None = None) -> None:
        """Counts one refused inbound message under a closed set of reasons (REJECT_REASONS),
        and under its sender when the sender is authenticated (e.g. ``client-3``)."""
        self._rejected.labels(**self._values, reason=reason).inc()
        if sender is not None:
            self._rejected_by_sender.labels(**self._values, sender=sender, reason=reason).inc()

    def count_bytes(self, sent: int, received: int) -> None:
        """Adds one call's traffic."""
        self.bytes_sent.inc(sent)
        self.bytes_received.inc(received)

    def traffic(self) -> tuple[int, int]:
        """Returns (bytes sent, bytes received) so far."""
        sent = self.registry.get_sample_value("fedcore_bytes_sent_total", self._values) or 0
        got = self.registry.get_sample_value("fedcore_bytes_received_total", self._values) or 0
        return int(sent), int(got)

    def serve(self, port: int, address: str = "127.0.0.1") -> None:
        """Serves ``/metrics`` on ``address:port`` from a daemon thread (port 0: no server)."""
        if port:
            start_http_server(port, addr=address, registry=self.registry)


HUB_ROUTES = ("server", "kdc", "api", "relay")
"""The closed set of ``route`` values of ``fedcore_hub_connections_total``."""


class HubMetrics:
    """The metrics of a hub's endpoint (docs/sites.md), on its own registry.

    Args:
        run: the run the hub serves ("" for none): a label on every series.
        registry: where the series are registered (default: a registry of their own).
    """

    def __init__(self, run: str = "", registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        labels = ["run"]
        self._run = run
        self._refused = Counter(
            "fedcore_hub_refused",
            "API calls and connections the hub's endpoint refused, by reason.",
            [*labels, "reason"],
            registry=self.registry,
        )
        self._connections = Counter(
            "fedcore_hub_connections",
            "Connections the hub's endpoint handed on, by route.",
            [*labels, "route"],
            registry=self.registry,
        )
        for route in HUB_ROUTES:
            self._connections.labels(run=run, route=route)
        self._last_seen = Gauge(
            "fedcore_hub_site_last_seen_timestamp_seconds",
            "When each site last called the hub's API (Unix time): a site whose link is lost "
            "stops moving it.",
            [*labels, "site"],
            registry=self.registry,
        )

    def site_seen(self, site: str) -> None:
        """Records that ``site`` called the hub's API now."""
        self._last_seen.labels(run=self._run, site=site).set_to_current_time()

    def refused(self, reason: str) -> None:
        """Counts one refused call or connection (``reason``: a short CamelCase word)."""
        self._refused.labels(run=self._run, reason=reason[:40]).inc()

    def routed(self, route: str) -> None:
        """Counts one connection handed to ``route`` (one of HUB_ROUTES)."""
        self._connections.labels(run=self._run, route=route).inc()

    def serve(self, port: int, address: str = "127.0.0.1") -> None:
        """Serves ``/metrics`` on ``address:port`` (port 0: no server)."""
        if port:
            start_http_server(port, addr=address, registry=self.registry)
