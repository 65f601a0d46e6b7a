"""The operator's Prometheus metrics (``fedcore_operator_*``), on their own registry."""

from __future__ import annotations

from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

import fedcore
from fedcore.sites.participation import ParticipationPhase
from fedcore.spec._status import PHASES

RESULTS = ("unchanged", "changed", "error")


class PhaseGauge:
    """A gauge of objects by phase, kept from each object's last observed phase."""

    def __init__(self, gauge: Gauge, phases: tuple[str, ...]) -> None:
        self.gauge = gauge
        self.phases = phases
        self._phases: dict[tuple[str, str], str] = {}
        for phase in phases:
            gauge.labels(phase).set(0)

    def observe(self, key: tuple[str, str], phase: str | None) -> None:
        """Records an object's phase (None: it is gone) and refreshes the gauge."""
        if phase is None:
            self._phases.pop(key, None)
        else:
            self._phases[key] = phase
        for name in self.phases:
            self.gauge.labels(name).set(sum(value == name for value in self._phases.values()))


class OperatorMetrics:
    """Reconciles by result and duration, API writes, runs and participations by phase,
    leadership."""

    def __init__(self) -> None:
        registry = self.registry = CollectorRegistry()
        Info("fedcore_build", "fedcore version of this process.", registry=registry).info(
            {"version": fedcore.__version__, "role": "operator", "run": ""}
        )
        self.reconciles = Counter(
            "fedcore_operator_reconciles",
            "Reconcile passes, by result (unchanged: no write; changed; error).",
            ["result"],
            registry=registry,
        )
        self.reconcile_duration = Histogram(
            "fedcore_operator_reconcile_duration_seconds",
            "Time one reconcile pass took.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )
        self.api_writes = Counter(
            "fedcore_operator_api_writes",
            "Writes to the API server, by verb.",
            ["verb"],
            registry=registry,
        )
        self.runs = Gauge(
            "fedcore_operator_runs", "FederatedRuns by phase.", ["phase"], registry=registry
        )
        self.participations = PhaseGauge(
            Gauge(
                "fedcore_operator_participations",
                "Participations (a site's approvals) by phase.",
                ["phase"],
                registry=registry,
            ),
            get_args(ParticipationPhase),
        )
        self.leader = Gauge(
            "fedcore_operator_leader",
            "1 while this replica holds the leader Lease, else 0.",
            registry=registry,
        )
        for result in RESULTS:
            self.reconciles.labels(result)
        self._runs = PhaseGauge(self.runs, tuple(PHASES))

    def observe_phase(self, key: tuple[str, str], phase: str | None) -> None:
        """Records a run's phase (None: the run is gone) and refreshes the by-phase gauge."""
        self._runs.observe(key, phase)

    def serve(self, port: int, address: str = "0.0.0.0") -> None:
        """Serves /metrics on ``address:port`` (0: not served)."""
        if port:
            start_http_server(port, addr=address, registry=self.registry)
