"""What a site hands each of its clients for one run: the approval and its data binding.

``fedcore site serve`` writes ``site-binding.json`` beside the run's manifest (the hub's text,
unchanged); a client started with ``--site-binding`` reads it, takes its data source from it
(the hub's manifest names none), and checks every task against it (:class:`RoundGuard`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fedcore._files import write_atomically
from fedcore.errors import FedcoreError
from fedcore.sites.policy import Approval, RoundGuard, spec_digest
from fedcore.spec import FederatedRun
from fedcore.spec._data import ClientDataSpec

BINDING_FILE = "site-binding.json"


@dataclass(frozen=True)
class SiteBinding:
    """A site's approval of one run, as its clients need it.

    Attributes:
        site: the site's name.
        digest: the digest of the spec the site reviewed (and approved).
        approval: the policy's approval (data binding and floor).
    """

    site: str
    digest: str
    approval: Approval

    def write(self, path: Path) -> None:
        """Writes the binding (mode 0600: it holds the site's data locations)."""
        document = {
            "site": self.site,
            "digest": self.digest,
            "approval": self.approval.model_dump(mode="json", by_alias=True, exclude_none=True),
        }
        write_atomically(Path(path), json.dumps(document, indent=1).encode(), mode=0o600)

    @classmethod
    def load(cls, path: Path) -> SiteBinding:
        """Reads a binding written by :meth:`write`.

        Raises:
            FedcoreError: the file is missing or malformed.
        """
        try:
            document = json.loads(Path(path).read_text(encoding="utf-8"))
            return cls(
                site=str(document["site"]),
                digest=str(document["digest"]),
                approval=Approval.model_validate(document["approval"]),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise FedcoreError(f"The site binding {path} is unreadable: {exc}") from exc

    def bind(self, run: FederatedRun) -> FederatedRun:
        """The run as this site's clients read it: each of its clients' data source taken
        from the approval (its '{index}' the client's index at the site), and their own
        checkpoints (a decentralized protocol's) in the site's folder, never in the hub's S3
        store (another organization's bucket, whose credentials the site does not hold); the
        rest unchanged.

        Raises:
            FedcoreError: the run is not the one approved, or not at this site.
        """
        own = run.spec.data.client_data
        clients = run.spec.site_clients(self.site)
        if len(clients) == 0:
            raise FedcoreError(f"Run {run.metadata.name!r} has no clients at site {self.site!r}.")
        if spec_digest(run) != self.digest:
            raise FedcoreError(
                f"The manifest of run {run.metadata.name!r} is not the one site {self.site!r} "
                f"approved (approved {self.digest}, this one {spec_digest(run)})."
            )
        if run.spec.checkpoint.s3 is not None:
            checkpoint = run.spec.checkpoint.model_copy(update={"s3": None})
            run = run.model_copy(
                update={"spec": run.spec.model_copy(update={"checkpoint": checkpoint})}
            )
        if own is None or self.approval.data is None:
            return run
        data = self.approval.data
        try:
            sources = [data.source_of(0)] * run.spec.clients.count
            for local, index in enumerate(clients):
                sources[index] = data.source_of(local)
        except IndexError as exc:
            raise FedcoreError(
                f"Site {self.site!r} binds data for {self.approval.clients} clients, but run "
                f"{run.metadata.name!r} gives it {len(clients)}: {exc}."
            ) from exc
        # Other sites' entries repeat this site's first source and are never read: a client
        # reads only its own index's (the hub's manifest names no site's data at all).
        bound = ClientDataSpec.model_construct(format=own.format, template=None, sources=sources)
        spec = run.spec.model_copy(
            update={"data": run.spec.data.model_copy(update={"client_data": bound})}
        )
        return run.model_copy(update={"spec": spec})

    def guard(self, run: FederatedRun) -> RoundGuard:
        """The per-task check of this approval for ``run``."""
        return RoundGuard(run, self.approval, self.site)
