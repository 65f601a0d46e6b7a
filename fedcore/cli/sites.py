"""``fedcore hub`` and ``fedcore site``: a hub that serves runs to sites, and the sites.

The hub admin: ``fedcore site add NAME`` (a one-time join token and the hub CA's fingerprint,
to hand the site out of band), ``fedcore site list``, ``fedcore site revoke NAME``, and
``fedcore hub serve MANIFEST``. A site's admin: ``fedcore site join`` (once), ``fedcore site
review MANIFEST`` (the digest to approve, and what the policy says of it) and ``fedcore site
serve``. See docs/sites.md.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path
from typing import Any

import click

from fedcore.errors import FedcoreError, RunAborted

HUB_DIR_HELP = "The hub's folder (its CA, its sites): created on first use, mode 0700."


def _duration(text: str) -> float:
    """Seconds in ``30m``, ``24h``, ``7d`` or a plain number of seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    unit = units.get(text[-1:])
    number = text[:-1] if unit else text
    try:
        value = float(number) * (unit or 1)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a duration like 30m, 24h or 7d.") from None
    if value <= 0:
        raise click.BadParameter(f"{text!r} is not a positive duration.")
    return value


def _logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@click.group("hub")
def hub() -> None:
    """Serve runs to sites: one TLS endpoint for the server, the KDC and enrollment."""


@hub.command("serve")
@click.argument("manifest", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--dir", "hub_dir", type=click.Path(path_type=Path), required=True, help=HUB_DIR_HELP)
@click.option(
    "--listen", default="0.0.0.0:7443", show_default=True, help="The endpoint's host:port."
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The run's folder at the hub (default: <hub dir>/runs/<name>).",
)
@click.option("--resume", is_flag=True, help="Continue from the latest good checkpoint.")
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=0,
    help="Serve the endpoint's /metrics (fedcore_hub_*) on this port of 127.0.0.1 (0: no).",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON summary as the last line of stdout."
)
def hub_serve(
    manifest: Path,
    hub_dir: Path,
    listen: str,
    workdir: Path | None,
    resume: bool,
    metrics_port: int,
    as_json: bool,
) -> None:
    """Serves MANIFEST (a run with spec.sites) to its sites until it ends."""
    from fedcore.cli.crash import raise_interrupt
    from fedcore.sites._registry import HubRegistry
    from fedcore.sites.hub_serve import HubServe
    from fedcore.spec import load_manifest

    _logging()
    run = load_manifest(manifest)
    registry = HubRegistry(hub_dir)
    serving = HubServe(
        run,
        manifest,
        registry,
        listen=listen,
        workdir=workdir or hub_dir / "runs" / run.metadata.name,
        resume=resume,
        metrics_port=metrics_port,
    )
    signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        port = serving.start()
        click.echo(
            f"Serving run {run.metadata.name} to sites "
            f"{[site.name for site in run.spec.sites or []]} on port {port}.",
            err=True,
        )
        result = serving.wait()
    except KeyboardInterrupt:
        serving.stop()
        raise RunAborted("The hub was stopped (Ctrl-C or SIGTERM).", reason="Interrupted") from None
    except BaseException:
        serving.stop()
        raise
    summary = result.as_json()
    click.echo(json.dumps(summary) if as_json else f"{summary['phase']}: {summary}")


@click.group("site")
def site() -> None:
    """Sites: add, list and revoke them (the hub); join, review and serve (a site)."""


@site.command("add")
@click.argument("name")
@click.option("--hub-dir", type=click.Path(path_type=Path), required=True, help=HUB_DIR_HELP)
@click.option(
    "--expires", default="24h", show_default=True, help="How long the token is valid (30m, 7d)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the token as JSON.")
def site_add(name: str, hub_dir: Path, expires: str, as_json: bool) -> None:
    """Registers site NAME and prints its one-time join token and the hub CA's fingerprint.

    Hand both to the site's admin out of band; the hub keeps only the token's digest."""
    from fedcore.sites._registry import HubRegistry

    token = HubRegistry(hub_dir).add_site(name, token_seconds=_duration(expires))
    if as_json:
        click.echo(
            json.dumps(
                {
                    "site": token.site,
                    "token": token.token,
                    "fingerprint": token.fingerprint,
                    "expires": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(token.expires)),
                }
            )
        )
        return
    click.echo(f"site:        {token.site}")
    click.echo(f"token:       {token.token}")
    click.echo(f"fingerprint: {token.fingerprint}")
    click.echo(f"expires:     {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(token.expires))}")


@site.command("list")
@click.option("--hub-dir", type=click.Path(path_type=Path), required=True, help=HUB_DIR_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def site_list(hub_dir: Path, as_json: bool) -> None:
    """Lists the hub's sites and their state (Invited, TokenExpired, Enrolled, Revoked)."""
    from fedcore.sites._registry import HubRegistry

    sites = HubRegistry(hub_dir).sites()
    if as_json:
        click.echo(json.dumps(sites))
        return
    for entry in sites:
        click.echo(f"{entry['name']:<24} {entry['state']:<13} enrolled {entry['enrolled']}")


@site.command("revoke")
@click.argument("name")
@click.option("--hub-dir", type=click.Path(path_type=Path), required=True, help=HUB_DIR_HELP)
def site_revoke(name: str, hub_dir: Path) -> None:
    """Revokes site NAME: refused at its next connection, its clients' uploads never used."""
    from fedcore.sites._registry import HubRegistry

    HubRegistry(hub_dir).revoke(name)
    click.echo(f"Site {name} is revoked.")


@site.command("join")
@click.option("--hub", "hub_address", required=True, help="The hub endpoint's host:port.")
@click.option(
    "--token",
    required=True,
    envvar="FEDCORE_JOIN_TOKEN",
    help="The one-time join token (better: in FEDCORE_JOIN_TOKEN, out of ps's sight).",
)
@click.option(
    "--fingerprint", required=True, help="The hub CA's fingerprint, given with the token."
)
@click.option(
    "--dir",
    "site_dir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="The site's folder: its key (never sent), certificate and hub address.",
)
def site_join(hub_address: str, token: str, fingerprint: str, site_dir: Path) -> None:
    """Enrolls this machine as a site: checks the hub, makes the key here, sends a request."""
    from fedcore.sites.site import join

    _logging()
    config = join(site_dir, hub=hub_address, token=token, expected_fingerprint=fingerprint)
    click.echo(f"Site {config.name} joined the hub at {config.hub}.")


@site.command("review")
@click.argument("manifest", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--policy",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="The site's policy file: say whether it approves MANIFEST, and why not.",
)
def site_review(manifest: Path, policy: Path | None) -> None:
    """Prints MANIFEST's spec digest (what a policy approves) and its planned epsilon."""
    from fedcore.sites.policy import (
        SiteRefused,
        load_policy,
        planned_epsilon,
        review,
        spec_digest,
    )
    from fedcore.spec import load_manifest

    run = load_manifest(manifest)
    click.echo(f"run:         {run.metadata.name}")
    click.echo(f"specDigest:  {spec_digest(run)}")
    click.echo(f"protocol:    {run.spec.protocol.name}")
    epsilon = planned_epsilon(run)
    click.echo("epsilon:     " + ("no DP claim" if epsilon is None else f"{epsilon:.4g}"))
    for entry in run.spec.sites or []:
        click.echo(f"site:        {entry.name} ({entry.clients} clients)")
    if policy is None:
        return
    try:
        review(load_policy(policy), run)
    except SiteRefused as exc:
        raise FedcoreError(f"The policy refuses this run ({exc.reason}): {exc}") from exc
    click.echo("The policy approves this run.")


@site.command("serve")
@click.option(
    "--dir",
    "site_dir",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    required=True,
    help="The joined site's folder.",
)
@click.option(
    "--policy",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    required=True,
    help="The site's policy: what it approves, its data, its privacy floor.",
)
@click.option(
    "--wait",
    default="10m",
    show_default=True,
    help="How long to wait for the hub to serve a run with this site.",
)
def site_serve(site_dir: Path, policy: Path, wait: str) -> None:
    """Takes part in the hub's run, as the policy allows, with this site's own clients."""
    from fedcore.cli.crash import raise_interrupt
    from fedcore.sites.site import SiteAgent

    _logging()
    agent = SiteAgent(site_dir, policy, wait_seconds=_duration(wait))
    signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        result: dict[str, Any] = agent.serve()
    except KeyboardInterrupt:
        agent.stop()
        raise RunAborted(
            "The site was stopped (Ctrl-C or SIGTERM).", reason="Interrupted"
        ) from None
    click.echo(f"Site {result['site']}: its clients {result['clients']} finished.")
