"""What a valid manifest would run, with every default resolved (``fedcore validate``).

:func:`describe` returns the summary as plain data (``fedcore validate --json`` prints it under
``"summary"``) and :func:`summary_lines` renders it as the lines ``fedcore validate`` prints.
Nothing here imports torch. The examples per client follow from counts alone for an IID
partition of a built-in source (its size is known); any other partition needs the data, which
is loaded (numpy and scikit-learn, a few seconds) only when asked (``--load-data``), else the
summary says it is computed at start.
"""

from __future__ import annotations

import statistics
from typing import Any

from fedcore.errors import SpecError, SpecIssue
from fedcore.spec import (
    BUILTIN_DATASETS,
    FederatedRun,
    FederatedRunSpec,
    PrivacySpec,
    protocol_facts,
    split_sizes,
)

PICKED_AT_START = "picked at start"
"""A port that a local run takes from the free loopback ports when it starts."""

AT_START = "computed at start"


def describe(
    run: FederatedRun, *, load_data: bool = False, source: str | None = None
) -> dict[str, Any]:
    """Returns what ``fedcore run`` would start for ``run``, as JSON-able data.

    Args:
        run: a validated manifest.
        load_data: load the data and partition it, to report every client's examples even
            when they do not follow from counts (Dirichlet, NpzFolder, ByFile).
        source: the manifest's file, named in a refusal.

    Returns:
        ``name``, ``protocol``, ``roles``, ``ports``, ``rounds``, ``clients``, ``privacy`` and
        ``data`` (see docs/operations.md for every key).

    Raises:
        SpecError: the data cannot be dealt as asked (a client would hold fewer than
            ``spec.data.partition.minExamples`` examples, or the data cannot be read).
    """
    spec = run.spec
    facts = protocol_facts(spec.protocol.name)
    count = spec.clients.count
    kdc = 1 if facts.needs_kdc else 0
    sampled = min(spec.clients.sampled_per_round(), count)
    return {
        "name": run.metadata.name,
        "protocol": {
            "name": facts.name,
            "mode": protocol_mode(spec),
            "dropout_policy": facts.dropout_policy,
            "decentralized": facts.decentralized,
        },
        "roles": {"kdc": kdc, "server": 1, "clients": count, "processes": kdc + 1 + count},
        "ports": {
            "server": PICKED_AT_START,
            "kdc": PICKED_AT_START if kdc else None,
            "peers": PICKED_AT_START if facts.decentralized else None,
            "metrics": PICKED_AT_START,
        },
        "rounds": spec.rounds,
        "clients": {
            "count": count,
            "per_round": sampled,
            "quorum": spec.clients.quorum_of(sampled),
            "sampling": spec.clients.sampling,
        },
        "privacy": _privacy(spec, sampled),
        "sites": None
        if spec.sites is None
        else [{"name": site.name, "clients": site.clients} for site in spec.sites],
        "data": _data(spec, load_data=load_data, source=source),
        "evaluation": spec.evaluation_where,
    }


def protocol_mode(spec: FederatedRunSpec) -> str | None:
    """The protocol's mode or variant in words (None for protocols without one)."""
    name = spec.protocol.name
    if name == "fedavg":
        options = spec.protocol.fedavg
        clusters = f", IFCA with {options.clusters} models" if options.clusters > 1 else ""
        return f"aggregator {options.aggregator}{clusters}"
    if name == "dp-fedavg":
        dp = spec.protocol.dp_fedavg
        return f"clipping norm {dp.clipping_norm:g}, noise multiplier {dp.noise_multiplier:g}"
    if name == "mpdp":
        return spec.protocol.mpdp.mode
    if name == "ebscfl":
        return f"{spec.protocol.ebscfl.mode}, {spec.protocol.ebscfl.clusters} clusters"
    if name == "lppa":
        lppa = spec.protocol.lppa
        return f"{lppa.variant} on a {lppa.topology.kind} graph"
    if name == "adaptive":
        adaptive = spec.protocol.adaptive
        return f"{adaptive.strategy}, {adaptive.measure} measure"
    return None


def _noise_off(spec: FederatedRunSpec) -> bool:
    """Whether a protocol that can claim DP runs without its noise here (then it claims none):
    secagg without distributedDp, mpdp with clientNoiseStd 0."""
    name = spec.protocol.name
    if name == "secagg":
        return spec.protocol.secagg_options().distributed_dp is None
    if name == "mpdp":
        return spec.protocol.mpdp.client_noise_std == 0
    return False


def _privacy(spec: FederatedRunSpec, sampled: int) -> dict[str, Any]:
    """The DP claim: accountant, budget and amplification, or ``claims_dp`` false."""
    if not protocol_facts(spec.protocol.name).claims_dp or _noise_off(spec):
        return {
            "claims_dp": False,
            "accountant": None,
            "target_epsilon": None,
            "target_delta": None,
            "amplification": None,
        }
    privacy = spec.privacy or PrivacySpec()
    secret = sampled < spec.clients.count and spec.clients.sampling == "Secret"
    return {
        "claims_dp": True,
        "accountant": privacy.accountant,
        "target_epsilon": privacy.target_epsilon,
        "target_delta": privacy.target_delta,
        "amplification": "SamplingWithoutReplacement" if secret else None,
    }


def _data(spec: FederatedRunSpec, *, load_data: bool, source: str | None) -> dict[str, Any]:
    """The data source, its split and the examples per client (or "computed at start")."""
    data = spec.data
    count = spec.clients.count
    if data.client_data is not None:
        return _own_data(spec, load_data=load_data, source=source)
    info: dict[str, Any] = {
        "source": data.source.kind,
        "path": data.source.path,
        "partition": data.partition.kind,
        "alpha": data.partition.alpha if data.partition.kind == "Dirichlet" else None,
        "examples": None,
        "train": None,
        "test": None,
        "per_client": None,
        "computed": AT_START,
    }
    sizes: list[int] | None = None
    facts = BUILTIN_DATASETS.get(data.source.kind)
    try:
        if load_data:
            sizes, train, test = _loaded_sizes(spec)
            info.update(examples=train + test, train=train, test=test, computed="loaded")
        elif facts is not None:
            train, test = split_sizes(facts.examples, data.test_fraction)
            info.update(examples=facts.examples, train=train, test=test)
            if data.partition.kind == "IID":
                sizes = _iid_sizes(train, count)
                info["computed"] = "counts"
    except ValueError as exc:
        issue = SpecIssue("spec.data", f"cannot be loaded and dealt to {count} clients: {exc}")
        raise SpecError([issue], source=source) from exc
    if sizes is not None:
        _check_sizes(sizes, spec, source)
        median = statistics.median(sizes)
        info["per_client"] = {
            "min": min(sizes),
            "median": int(median) if float(median).is_integer() else median,
            "max": max(sizes),
        }
    return info


def _own_data(spec: FederatedRunSpec, *, load_data: bool, source: str | None) -> dict[str, Any]:
    """Each client's own source: where, in what format, under which schema; with
    ``load_data``, each client's examples (read and checked as the clients will)."""
    own = spec.data.client_data
    schema = spec.data.schema_
    assert own is not None and schema is not None
    if own.bound_by_sites:
        kind = "bound by each site"
    else:
        sample = own.template if own.template is not None else own.sources[0]  # type: ignore[index]
        kind = "path" if sample.path else "volumeClaim" if sample.volume_claim else "s3"
    if schema.features is not None:
        shape = f"{len(schema.features)} features"
    elif schema.image is not None:
        image = schema.image
        shape = f"{image.width}x{image.height} images, {image.channels} channel(s)"
    else:
        shape = f"examples of shape {list(schema.shape or [])}"
    info: dict[str, Any] = {
        "source": "ClientData",
        "format": own.format,
        "location": kind,
        "template": own.template is not None,
        "schema": f"{shape}, {len(schema.labels)} labels",
        "examples": None,
        "train": None,
        "test": None,
        "per_client": None,
        "computed": AT_START,
    }
    if load_data and own.bound_by_sites:
        raise SpecError(
            [
                SpecIssue(
                    "spec.data.clientData",
                    "each site binds its own clients' data, which only that site can read: "
                    "--load-data has nothing to load here.",
                )
            ],
            source=source,
        )
    if load_data:
        from fedcore.learning.data import own_data

        try:
            loaded = [own_data(spec, index) for index in range(spec.clients.count)]
        except ValueError as exc:
            raise SpecError([SpecIssue("spec.data.clientData", str(exc))], source=source) from exc
        sizes = [len(data.train) for data in loaded]
        test = sum(len(data.test) for data in loaded)
        median = statistics.median(sizes)
        info.update(
            examples=sum(sizes) + test,
            train=sum(sizes),
            test=test,
            computed="loaded",
            per_client={
                "min": min(sizes),
                "median": int(median) if float(median).is_integer() else median,
                "max": max(sizes),
            },
        )
    return info


def _iid_sizes(train: int, count: int) -> list[int]:
    """The shard sizes of ``np.array_split`` of ``train`` rows into ``count`` shards."""
    base, extra = divmod(train, count)
    return [base + 1] * extra + [base] * (count - extra)


def _loaded_sizes(spec: FederatedRunSpec) -> tuple[list[int], int, int]:
    """Loads the data and deals it as the clients will; returns (sizes, train, test).

    Raises:
        ValueError: the data cannot be read, or the partition is refused.
    """
    from fedcore.learning.data import load_client_file, load_split, partition_indices

    train, test = load_split(spec.data)
    count = spec.clients.count
    if spec.data.partition.kind == "ByFile":
        sizes = [len(load_client_file(spec.data.source, index)) for index in range(count)]
        return sizes, sum(sizes), len(test)
    shards = partition_indices(train.y, count, spec.data.partition, spec.seed)
    return [len(shard) for shard in shards], len(train), len(test)


def _check_sizes(sizes: list[int], spec: FederatedRunSpec, source: str | None) -> None:
    """Refuses a partition that leaves a client with fewer than minExamples examples.

    Raises:
        SpecError: naming spec.clients.count or spec.data.partition.minExamples.
    """
    least = spec.data.partition.min_examples
    smallest = min(sizes)
    if smallest >= least:
        return
    count = spec.clients.count
    if smallest == 0:
        issue = SpecIssue(
            "spec.clients.count",
            f"{count} clients cannot share the {sum(sizes)} training examples: a client would "
            f"hold none; allowed: at most {sum(sizes) // least} clients here.",
            value=count,
            allowed=f"1 to {sum(sizes) // least}",
        )
    else:
        client = sizes.index(smallest)
        issue = SpecIssue(
            "spec.data.partition.minExamples",
            f"{least} is more than client {client}'s {smallest} training examples; allowed: "
            f"1 to {smallest}, or fewer clients.",
            value=least,
            allowed=f"1 to {smallest}",
        )
    raise SpecError([issue], source=source)


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """Renders :func:`describe`'s data as indented ``key: text`` lines."""
    protocol = summary["protocol"]
    roles = summary["roles"]
    clients = summary["clients"]
    mode = f" ({protocol['mode']})" if protocol["mode"] else ""
    parts = [f"{roles['kdc']} KDC"] if roles["kdc"] else []
    parts += ["1 server", f"{roles['clients']} clients"]
    peers = ", clients linked to their peers" if protocol["decentralized"] else ""
    ports = [words for name, words in _PORT_WORDS.items() if summary["ports"][name]]
    lines = [
        f"protocol: {protocol['name']}{mode}; dropout policy {protocol['dropout_policy']}",
        f"roles:    {', '.join(parts)}: {roles['processes']} processes{peers}",
        f"ports:    {PICKED_AT_START}: free 127.0.0.1 ports for {', '.join(ports)}",
        f"rounds:   {summary['rounds']}; {clients['per_round']} of {clients['count']} clients "
        f"per round ({clients['sampling']} sample), quorum {clients['quorum']}",
        f"privacy:  {_privacy_text(summary['privacy'])}",
        f"data:     {_data_text(summary['data'], clients['count'])}",
        *(
            [
                "sites:    "
                + ", ".join(f"{site['name']} ({site['clients']})" for site in summary["sites"])
                + "; a hub serves it (fedcore hub serve, docs/sites.md)"
            ]
            if summary.get("sites")
            else []
        ),
        f"evaluate: {_EVALUATION_WORDS[summary['evaluation']]}",
    ]
    return [f"  {line}" for line in lines]


_EVALUATION_WORDS = {
    "Server": "on the server's held-out split",
    "Clients": "on the clients' held-out examples (their counts summed by the server)",
    "Both": "on the server's held-out split and on the clients' (the clients' is the result)",
}

_PORT_WORDS = {
    "server": "the server",
    "kdc": "the KDC",
    "peers": "each client's peer links",
    "metrics": "each role's /metrics (none with --no-metrics)",
}


def _privacy_text(privacy: dict[str, Any]) -> str:
    if not privacy["claims_dp"]:
        return "no DP claim"
    budget = (
        f"budget epsilon {privacy['target_epsilon']:g} (the run stops before exceeding it)"
        if privacy["target_epsilon"] is not None
        else "no budget (epsilon reported every round)"
    )
    amplification = (
        "amplification by the secret sample claimed"
        if privacy["amplification"]
        else "no amplification claimed"
    )
    return (
        f"(epsilon, delta)-DP, delta {privacy['target_delta']:g}; {budget}; accountant "
        f"{privacy['accountant']}; {amplification}"
    )


def _data_text(data: dict[str, Any], count: int) -> str:
    if data["source"] == "ClientData":
        given = (
            "each site's policy"
            if data["location"] == "bound by each site"
            else "one template"
            if data["template"]
            else "one source per client"
        )
        text = (
            f"each client's own {data['format']} data ({data['location']}, {given}); "
            f"schema {data['schema']}"
        )
        if data["location"] == "bound by each site":
            return f"{text}; examples per client read at each site"
        if data["per_client"] is None:
            return f"{text}; examples per client {AT_START} (--load-data reads them now)"
        per_client = data["per_client"]
        return (
            f"{text}; {data['train']} training and {data['test']} held-out examples, "
            f"{per_client['min']} / {per_client['median']} / {per_client['max']} per client "
            f"(min / median / max)"
        )
    where = data["source"] + (f" {data['path']}" if data["path"] else "")
    if data["examples"] is not None:
        where += (
            f", {data['examples']} examples ({data['train']} training, {data['test']} held out)"
        )
    partition = data["partition"]
    if data["alpha"] is not None:
        partition += f"(alpha {data['alpha']:g})"
    per_client = data["per_client"]
    if per_client is None:
        shares = f"examples per client {AT_START} (--load-data computes them now)"
    else:
        shares = (
            f"{per_client['min']} / {per_client['median']} / {per_client['max']} examples per "
            f"client (min / median / max)"
        )
    return f"{where}; {partition} over {count} clients: {shares}"
