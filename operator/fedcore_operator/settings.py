"""The operator's own settings, read once from its environment (the chart sets them)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from fedcore import __version__

DEFAULT_IMAGE = f"ghcr.io/fedcore/fedcore:{__version__}"


@dataclass(frozen=True)
class OperatorSettings:
    """How the operator builds pods and where it listens.

    Attributes:
        image: the runtime image of every role's pod unless the run names its own.
        image_pull_policy: the pods' imagePullPolicy.
        python: the interpreter command in the runtime image.
        server_port, kdc_port, peer_port, metrics_port: the roles' container ports.
        api_ports: TCP ports the server's egress NetworkPolicy opens towards the API server.
        run_as_user: the non-root uid (and gid) every pod runs as.
        resync_seconds: how often every run is reconciled even when nothing changed.
        finish_grace_seconds: how long the pods still running when a run succeeds may take to
            end on their own (clients writing their final models) before they are deleted.
        extra_env: environment added to every role's container (e.g. a proxy setting).
    """

    image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    python: str = "python"
    server_port: int = 7070
    kdc_port: int = 7071
    peer_port: int = 7072
    metrics_port: int = 9090
    api_ports: tuple[int, ...] = (443, 6443)
    run_as_user: int = 10001
    resync_seconds: float = 30.0
    finish_grace_seconds: float = 30.0
    extra_env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> OperatorSettings:
        """Reads ``FEDCORE_OPERATOR_*`` variables; unset ones keep their defaults."""
        env = dict(os.environ if environ is None else environ)
        prefix = "FEDCORE_OPERATOR_"
        extra = {
            key[len(prefix + "POD_ENV_") :]: value
            for key, value in env.items()
            if key.startswith(prefix + "POD_ENV_")
        }
        api_ports = env.get(prefix + "API_PORTS")
        return cls(
            image=env.get(prefix + "IMAGE", DEFAULT_IMAGE),
            image_pull_policy=env.get(prefix + "IMAGE_PULL_POLICY", "IfNotPresent"),
            python=env.get(prefix + "PYTHON", "python"),
            api_ports=tuple(int(port) for port in api_ports.split(","))
            if api_ports
            else (443, 6443),
            resync_seconds=float(env.get(prefix + "RESYNC_SECONDS", "30")),
            finish_grace_seconds=float(env.get(prefix + "FINISH_GRACE_SECONDS", "30")),
            extra_env=extra,
        )
