"""``fedcore-operator`` (or ``python -m fedcore_operator``): run the operator, print the CRD."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import sys
import threading
from pathlib import Path

import click
import kopf
from kubernetes import client, config

from fedcore.observe.kube_status import load_in_cluster
from fedcore_operator.crd import crds_yaml, write_crds
from fedcore_operator.hub.service import HubService
from fedcore_operator.kube import Kube
from fedcore_operator.leader import LeaseElector
from fedcore_operator.metrics import OperatorMetrics
from fedcore_operator.reconcile import Reconciler
from fedcore_operator.runtime import WebhookConfig, build_registry
from fedcore_operator.settings import OperatorSettings
from fedcore_operator.site.reconcile import SiteReconciler, SiteSettings

log = logging.getLogger("fedcore_operator")


@click.group()
@click.version_option(package_name="fedcore")
def main() -> None:
    """The fedcore operator: reconciles FederatedRuns into pods."""


@main.command()
@click.option("--write", is_flag=True, help="Write it into the chart instead of printing it.")
def crd(write: bool) -> None:
    """Prints the CRDs (FederatedRun, Participation) generated from the models."""
    if write:
        for path in write_crds():
            click.echo(f"Wrote {path}")
    else:
        click.echo(crds_yaml(), nl=False)


@main.command()
@click.option("--namespace", "namespaces", multiple=True, help="Watch only these namespaces.")
@click.option(
    "--kubeconfig",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Use this kubeconfig instead of the in-cluster ServiceAccount.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=8080,
    show_default=True,
    envvar="FEDCORE_OPERATOR_METRICS_PORT",
    help="Serve /metrics here (0: no).",
)
@click.option(
    "--metrics-address",
    default="0.0.0.0",
    show_default=True,
    help="The address /metrics and /healthz bind to.",
)
@click.option(
    "--health-port",
    type=click.IntRange(0, 65535),
    default=8081,
    show_default=True,
    envvar="FEDCORE_OPERATOR_HEALTH_PORT",
    help="Serve /healthz here (0: no).",
)
@click.option(
    "--leader-election/--no-leader-election",
    default=True,
    show_default=True,
    help="Hold a Lease before reconciling (needed with more than one replica).",
)
@click.option(
    "--lease-namespace", envvar="FEDCORE_OPERATOR_NAMESPACE", default="default", show_default=True
)
@click.option("--lease-name", default="fedcore-operator", show_default=True)
@click.option(
    "--ca-namespace",
    envvar="FEDCORE_OPERATOR_CA_NAMESPACE",
    default=None,
    help="Keep the runs' CA Secrets here (default: the lease namespace, the operator's own).",
)
@click.option(
    "--webhook-port",
    type=click.IntRange(0, 65535),
    default=0,
    envvar="FEDCORE_OPERATOR_WEBHOOK_PORT",
    help="Serve the validating webhook (0: no).",
)
@click.option("--webhook-address", default="0.0.0.0", show_default=True)
@click.option("--webhook-host", default=None, help="The host the API server calls (managed).")
@click.option(
    "--webhook-cert",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    envvar="FEDCORE_OPERATOR_WEBHOOK_CERT",
    default=None,
)
@click.option(
    "--webhook-key",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    envvar="FEDCORE_OPERATOR_WEBHOOK_KEY",
    default=None,
)
@click.option(
    "--webhook-ca",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    envvar="FEDCORE_OPERATOR_WEBHOOK_CA",
    default=None,
)
@click.option(
    "--manage-webhook",
    default=None,
    metavar="NAME",
    help="Create and keep the ValidatingWebhookConfiguration NAME (else the chart installs it).",
)
@click.option(
    "--log-format", type=click.Choice(["plain", "json"]), default="json", show_default=True
)
@click.option(
    "--mode",
    type=click.Choice(["hub", "site", "both"]),
    default="both",
    show_default=True,
    envvar="FEDCORE_OPERATOR_MODE",
    help="hub: reconcile FederatedRuns; site: reconcile Participations (needs FEDCORE_SITE_HUB "
    "and FEDCORE_SITE_FINGERPRINT); both: both (Participations only when FEDCORE_SITE_HUB is "
    "set).",
)
@click.option(
    "--site-resync-seconds",
    type=click.FloatRange(0.5),
    default=5.0,
    show_default=True,
    envvar="FEDCORE_SITE_RESYNC_SECONDS",
    help="How often each Participation asks the hub about its run.",
)
@click.option(
    "--hub-listen",
    default="",
    envvar="FEDCORE_HUB_LISTEN",
    help="Serve the hub's endpoint (runs with spec.sites) on this host:port; empty: none.",
)
def run(
    namespaces: tuple[str, ...],
    kubeconfig: str | None,
    metrics_port: int,
    metrics_address: str,
    health_port: int,
    leader_election: bool,
    lease_namespace: str,
    lease_name: str,
    ca_namespace: str | None,
    webhook_port: int,
    webhook_address: str,
    webhook_host: str | None,
    webhook_cert: Path | None,
    webhook_key: Path | None,
    webhook_ca: Path | None,
    manage_webhook: str | None,
    log_format: str,
    mode: str,
    site_resync_seconds: float,
    hub_listen: str,
) -> None:
    """Runs the operator until SIGTERM (graceful) or the loss of the leader Lease."""
    _configure_logging(log_format)
    if hub_listen and mode == "site":
        raise click.UsageError("--hub-listen: a hub's endpoint needs --mode hub or both.")
    try:
        site_settings = SiteSettings.from_env(lease_namespace) if mode != "hub" else None
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    if mode == "site" and site_settings is None:
        raise click.UsageError(
            "--mode site needs FEDCORE_SITE_HUB (the hub endpoint's host:port) and "
            "FEDCORE_SITE_FINGERPRINT (its CA's fingerprint)."
        )
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig)
    else:
        load_in_cluster()
    settings = dataclasses.replace(
        OperatorSettings.from_env(), ca_namespace=ca_namespace or lease_namespace
    )
    metrics = OperatorMetrics()
    metrics.serve(metrics_port, metrics_address)
    api = client.ApiClient()
    kube = Kube(api, on_write=lambda verb: metrics.api_writes.labels(verb).inc())
    reconciler = Reconciler(kube, settings) if mode != "site" else None
    site = None if site_settings is None else SiteReconciler(kube, settings, site_settings)
    webhook = None
    if webhook_port and (reconciler is not None or site is not None):
        webhook = WebhookConfig(
            port=webhook_port,
            address=webhook_address,
            host=webhook_host,
            certfile=webhook_cert,
            keyfile=webhook_key,
            cafile=webhook_ca,
            managed=manage_webhook,
        )
    stop_flag = threading.Event()
    lost = threading.Event()
    elector: LeaseElector | None = None
    if leader_election:
        identity = f"{socket.gethostname()}-{os.getpid()}"

        def on_lost() -> None:
            metrics.leader.set(0)
            lost.set()
            stop_flag.set()

        elector = LeaseElector(lease_name, lease_namespace, identity, on_lost=on_lost)
        elector.start()
        log.info("Waiting for the leader Lease %s/%s as %s.", lease_namespace, lease_name, identity)
        while not elector.wait(1.0):
            if lost.is_set():
                sys.exit(1)
        metrics.leader.set(1)
    else:
        metrics.leader.set(1)
    hub = None
    if reconciler is not None and hub_listen:
        # Only the leader serves: the registry's Secret has one writer.
        hub = HubService(kube, settings, hub_listen, metrics_registry=metrics.registry)
        hub.start()
        reconciler.hub = hub
    registry = build_registry(
        reconciler,
        metrics,
        resync_seconds=settings.resync_seconds,
        webhook=webhook,
        site=site,
        site_resync_seconds=site_resync_seconds,
        hub=hub,
    )
    liveness = f"http://{metrics_address}:{health_port}/healthz" if health_port else None

    async def operate() -> None:
        try:
            await kopf.operator(
                registry=registry,
                standalone=True,
                clusterwide=not namespaces,
                namespaces=list(namespaces),
                stop_flag=stop_flag,
                liveness_endpoint=liveness,
            )
        finally:
            stop_flag.set()  # frees kopf's thread that waits on the flag

    asyncio.run(operate())
    if elector is not None:
        elector.release()
    if lost.is_set():
        sys.exit(1)


def _configure_logging(log_format: str) -> None:
    """Structured logs: one JSON object per line, with the run's name and namespace."""
    kopf.configure(log_format=kopf.LogFormat.JSON if log_format == "json" else kopf.LogFormat.FULL)
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    logging.getLogger("leaderelection").setLevel(logging.WARNING)
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)


if __name__ == "__main__":
    main()
