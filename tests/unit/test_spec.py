"""Tests of fedcore.spec: validation, error paths and messages, defaults, round trips."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fedcore.errors import SpecError, SpecIssue
from fedcore.spec import FederatedRun, load_manifest, parse_manifest, resolve_share

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "digits-fedavg.yaml"

BASE: dict[str, Any] = {
    "apiVersion": "fedcore.dev/v1alpha1",
    "kind": "FederatedRun",
    "metadata": {"name": "digits-test"},
    "spec": {
        "protocol": {"name": "fedavg"},
        "model": {"kind": "MLP", "hidden": [32]},
        "data": {"source": {"kind": "Digits"}, "partition": {"kind": "IID"}},
        "clients": {"count": 10},
        "rounds": 3,
        "training": {"batchSize": 16, "optimizer": {"kind": "SGD", "learningRate": 0.1}},
    },
}
"""A small valid manifest; every table case below changes one or two things in it."""

DELETE = object()
"""A change's value that removes the key instead of setting it."""


def _mutated(changes: dict[tuple[str, ...], Any]) -> dict[str, Any]:
    document = copy.deepcopy(BASE)
    for keys, value in changes.items():
        parent = document
        for key in keys[:-1]:
            parent = parent.setdefault(key, {})
        if value is DELETE:
            del parent[keys[-1]]
        else:
            parent[keys[-1]] = value
    return document


def _issues(document: Any) -> list[SpecIssue]:
    with pytest.raises(SpecError) as caught:
        parse_manifest(document, source="test.yaml")
    return caught.value.issues


def _case(case_id: str, changes: dict[tuple[str, ...], Any], path: str, fragment: str) -> Any:
    return pytest.param(changes, path, fragment, id=case_id)


INVALID = [
    _case(
        "wrong-apiVersion",
        {("apiVersion",): "fedcore.dev/v1"},
        "apiVersion",
        "allowed: 'fedcore.dev/v1alpha1'",
    ),
    _case("wrong-kind", {("kind",): "Job"}, "kind", "allowed: 'FederatedRun'"),
    _case("missing-name", {("metadata", "name"): DELETE}, "metadata.name", "is required"),
    _case(
        "bad-name-pattern",
        {("metadata", "name"): "Digits_Run"},
        "metadata.name",
        "matching '^[a-z0-9]([-a-z0-9]*[a-z0-9])?$'",
    ),
    _case("name-over-63", {("metadata", "name"): "a" * 64}, "metadata.name", "length 1 to 63"),
    _case(
        "name-too-long-for-count",
        {("metadata", "name"): "a" * 55},
        "metadata.name",
        "would have 68 characters; at most 63 allowed",
    ),
    _case("missing-protocol", {("spec", "protocol"): DELETE}, "spec.protocol", "is required"),
    _case(
        "unknown-protocol",
        {("spec", "protocol", "name"): "fedprox"},
        "spec.protocol.name",
        "one of 'fedavg', 'fedsgd'",
    ),
    _case(
        "unknown-field-root",
        {("specs",): {}},
        "specs",
        "allowed fields here: apiVersion, kind, metadata, spec, status",
    ),
    _case(
        "unknown-field-spec",
        {("spec", "round"): 3},
        "spec.round",
        "allowed fields here: activeDeadlineSeconds, attack, backoffLimit, checkpoint, clients,",
    ),
    _case(
        "unknown-field-deep",
        {("spec", "training", "optimizer", "lr"): 0.1},
        "spec.training.optimizer.lr",
        "allowed fields here: kind, learningRate, momentum, weightDecay",
    ),
    _case(
        "unknown-field-in-list",
        {("spec", "roles", "clients", "tolerations"): [{"key": "gpu", "tolerance": 1}]},
        "spec.roles.clients.tolerations[0].tolerance",
        "allowed fields here: effect, key, operator, value",
    ),
    _case(
        "count-0", {("spec", "clients", "count"): 0}, "spec.clients.count", "allowed: 1 to 10000"
    ),
    _case(
        "count-10001",
        {("spec", "clients", "count"): 10001},
        "spec.clients.count",
        "allowed: 1 to 10000",
    ),
    _case(
        "perRound-0%",
        {("spec", "clients", "perRound"): "0%"},
        "spec.clients.perRound",
        "a percentage from '1%' to '100%'",
    ),
    _case(
        "perRound-101%",
        {("spec", "clients", "perRound"): "101%"},
        "spec.clients.perRound",
        "a percentage from '1%' to '100%'",
    ),
    _case(
        "perRound-abc",
        {("spec", "clients", "perRound"): "abc"},
        "spec.clients.perRound",
        "must be a count (a whole number >= 1) or a percentage",
    ),
    _case(
        "perRound-true",
        {("spec", "clients", "perRound"): True},
        "spec.clients.perRound",
        "True is not allowed: must be a count (a whole number >= 1)",
    ),
    _case(
        "perRound-0",
        {("spec", "clients", "perRound"): 0},
        "spec.clients.perRound",
        "a count must be at least 1",
    ),
    _case(
        "perRound-over-count",
        {("spec", "clients", "perRound"): 11},
        "spec.clients.perRound",
        "more than spec.clients.count (10); allowed: 1 to 10 or a percentage",
    ),
    _case(
        "quorum-over-perRound",
        {("spec", "clients", "perRound"): 5, ("spec", "clients", "quorum"): 6},
        "spec.clients.quorum",
        "allowed: 1 to 5 or a percentage",
    ),
    _case("rounds-0", {("spec", "rounds"): 0}, "spec.rounds", "allowed: 1 to 1000000"),
    _case(
        "rounds-string",
        {("spec", "rounds"): "ten"},
        "spec.rounds",
        "'ten' is a string; expected an integer",
    ),
    _case("rounds-fraction", {("spec", "rounds"): 2.5}, "spec.rounds", "expected an integer"),
    _case(
        "learningRate-negative",
        {("spec", "training", "optimizer", "learningRate"): -0.5},
        "spec.training.optimizer.learningRate",
        "allowed: more than 0 and at most 100",
    ),
    _case(
        "testFraction-1",
        {("spec", "data", "testFraction"): 1.0},
        "spec.data.testFraction",
        "allowed: more than 0 and less than 1",
    ),
    _case(
        "dirichlet-alpha-0",
        {("spec", "data", "partition"): {"kind": "Dirichlet", "alpha": 0}},
        "spec.data.partition.alpha",
        "allowed: more than 0",
    ),
    _case(
        "byfile-with-digits",
        {("spec", "data", "partition", "kind"): "ByFile"},
        "spec.data.partition.kind",
        "needs spec.data.source.kind NpzFolder",
    ),
    _case(
        "npzfolder-without-path",
        {("spec", "data", "source"): {"kind": "NpzFolder"}},
        "spec.data.source.path",
        "is required when kind is NpzFolder",
    ),
    _case(
        "npzfolder-empty-path",
        {("spec", "data", "source"): {"kind": "NpzFolder", "path": ""}},
        "spec.data.source.path",
        "allowed: length at least 1",
    ),
    _case(
        "import-without-importPath",
        {("spec", "model"): {"kind": "Import"}},
        "spec.model.importPath",
        "is required when kind is Import",
    ),
    _case(
        "importPath-bad-pattern",
        {("spec", "model"): {"kind": "Import", "importPath": "my module.build"}},
        "spec.model.importPath",
        "matching '^[A-Za-z_][A-Za-z0-9_.]*:",
    ),
    _case(
        "targetEpsilon-with-fedavg",
        {("spec", "privacy"): {"targetEpsilon": 1.0}},
        "spec.privacy.targetEpsilon",
        "makes no differential-privacy claim",
    ),
    _case(
        "secret-sample-with-pld",
        {
            ("spec", "protocol"): {"name": "dp-fedavg"},
            ("spec", "clients"): {"count": 10, "perRound": 3, "sampling": "Secret"},
            ("spec", "privacy"): {"accountant": "PLD"},
        },
        "spec.privacy.accountant",
        "'PLD' cannot account a secret sample",
    ),
    _case(
        "sampling-lowercase",
        {("spec", "clients"): {"count": 10, "sampling": "secret"}},
        "spec.clients.sampling",
        "allowed: one of 'Seeded', 'Secret'",
    ),
    _case(
        "dtype-float16",
        {("spec", "model", "dtype"): "float16"},
        "spec.model.dtype",
        "allowed: one of 'float32', 'float64'",
    ),
    _case("spec-is-list", {("spec",): [1, 2]}, "spec", "is a list; expected a mapping of fields"),
    _case(
        "hidden-0",
        {("spec", "model", "hidden"): [64, 0]},
        "spec.model.hidden[1]",
        "allowed: 1 to 1000000",
    ),
    _case(
        "hidden-too-many",
        {("spec", "model", "hidden"): [8] * 65},
        "spec.model.hidden",
        "allowed: at most 64 items",
    ),
    _case(
        "int-where-string",
        {("spec", "roles", "server", "nodeSelector"): {"zone": 5}},
        "spec.roles.server.nodeSelector.zone",
        "5 is an integer; expected a string",
    ),
    _case(
        "toleration-effect",
        {("spec", "roles", "kdc", "tolerations"): [{"effect": "Never"}]},
        "spec.roles.kdc.tolerations[0].effect",
        "one of 'NoSchedule', 'PreferNoSchedule', 'NoExecute'",
    ),
    _case(
        "boolean-not-boolean",
        {("spec", "evaluation", "releaseFinalModel"): "maybe"},
        "spec.evaluation.releaseFinalModel",
        "expected true or false",
    ),
    _case(
        "secagg-rates-no-graph-serves",
        {
            ("spec", "protocol"): {
                "name": "secagg",
                "secagg": {"dropoutRate": 0.4, "corruptRate": 0.3},
            }
        },
        "spec.protocol.secagg.dropoutRate",
        "2 * dropout + corrupt < 1",
    ),
    _case(
        "secagg-too-few-clients-for-the-bounds",
        {
            ("spec", "protocol"): {
                "name": "secagg",
                "secagg": {"dropoutRate": 0.3, "corruptRate": 0.3},
            },
            ("spec", "clients", "count"): 4,
        },
        "spec.protocol.secagg.dropoutRate",
        "too small",
    ),
    _case(
        "secagg-threshold-below-the-security-bound",
        {("spec", "protocol"): {"name": "secagg", "secagg": {"threshold": 1}}},
        "spec.protocol.secagg.threshold",
        "fail the security bound",
    ),
    _case(
        "secagg-odd-degree",
        {
            ("spec", "protocol"): {"name": "secagg", "secagg": {"degree": 5}},
            ("spec", "clients", "count"): 20,
        },
        "spec.protocol.secagg.degree",
        "odd",
    ),
    _case(
        "secagg-compressed-uploads",
        {
            ("spec", "protocol"): {"name": "secagg"},
            ("spec", "transport"): {"compression": {"uploads": "Int8"}},
        },
        "spec.transport.compression.uploads",
        "masks cancel in the sum only when every masked input is exact",
    ),
    _case(
        "drop-after-sharing-without-secagg",
        {("spec", "attack"): {"kind": "DropAfterSharing"}},
        "spec.attack.kind",
        "drops a client between secagg's stages",
    ),
    _case(
        "secagg-dropout-rate-out-of-range",
        {("spec", "protocol"): {"name": "secagg", "secagg": {"dropoutRate": 0.5}}},
        "spec.protocol.secagg.dropoutRate",
        "less than 0.5",
    ),
    _case(
        "checkpoint-every-negative",
        {("spec", "checkpoint", "everyRounds"): -1},
        "spec.checkpoint.everyRounds",
        "allowed: at least 0",
    ),
]


@pytest.mark.parametrize(("changes", "path", "fragment"), INVALID)
def test_parse_manifest_invalid_names_field_and_allowed(
    changes: dict[tuple[str, ...], Any], path: str, fragment: str
) -> None:
    # Prepare
    document = _mutated(changes)

    # Execute
    issues = _issues(document)

    # Assert
    assert [issue.path for issue in issues] == [path], issues
    assert fragment in issues[0].message
    assert issues[0].message.endswith("."), "every message is a full sentence"


def test_invalid_table_is_large_enough() -> None:
    assert len(INVALID) >= 25


def test_base_manifest_is_valid() -> None:
    run = parse_manifest(copy.deepcopy(BASE))

    assert run.metadata.name == "digits-test"
    assert run.spec.clients.count == 10


@pytest.mark.parametrize("document", [[], "just text", None, 42], ids=repr)
def test_parse_manifest_not_a_mapping_reports_root(document: Any) -> None:
    issues = _issues(document)

    assert [issue.path for issue in issues] == ["<root>"]
    assert "must be a mapping with apiVersion, kind, metadata and spec" in issues[0].message


def test_load_manifest_invalid_yaml_reports_file() -> None:
    # Execute
    with pytest.raises(SpecError) as caught:
        load_manifest("broken.yaml", text="spec: [unclosed\n  rounds: 3")

    # Assert
    assert [issue.path for issue in caught.value.issues] == ["<file>"]
    assert "is not valid YAML" in caught.value.issues[0].message
    assert "broken.yaml" in str(caught.value)


def test_load_manifest_missing_file_reports_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as caught:
        load_manifest(tmp_path / "absent.yaml")

    assert [issue.path for issue in caught.value.issues] == ["<file>"]
    assert "cannot be read" in caught.value.issues[0].message


def test_parse_manifest_reports_every_schema_error_at_once() -> None:
    # Prepare
    document = _mutated(
        {
            ("spec", "clients", "count"): 0,
            ("spec", "rounds"): "many",
            ("spec", "seeds"): 1,
            ("metadata", "name"): "Bad Name",
        }
    )

    # Execute
    issues = _issues(document)

    # Assert
    assert sorted(issue.path for issue in issues) == [
        "metadata.name",
        "spec.clients.count",
        "spec.rounds",
        "spec.seeds",
    ]


def test_parse_manifest_reports_every_cross_field_error_at_once() -> None:
    # Prepare
    document = _mutated(
        {
            ("spec", "model"): {"kind": "Import"},
            ("spec", "data", "source"): {"kind": "NpzFolder"},
            ("spec", "clients", "perRound"): 20,
            ("spec", "privacy"): {"targetEpsilon": 3.0},
        }
    )

    # Execute
    issues = _issues(document)

    # Assert
    assert {issue.path for issue in issues} == {
        "spec.model.importPath",
        "spec.data.source.path",
        "spec.clients.perRound",
        "spec.privacy.targetEpsilon",
    }


def test_spec_error_message_lists_source_and_paths() -> None:
    with pytest.raises(SpecError) as caught:
        parse_manifest(_mutated({("spec", "rounds"): 0}), source="run.yaml")

    text = str(caught.value)
    assert "in run.yaml" in text
    assert "  - spec.rounds: 0 is not allowed; allowed: 1 to 1000000." in text


def test_load_manifest_example_is_valid() -> None:
    run = load_manifest(EXAMPLE)

    assert run.metadata.name == "digits-fedavg"
    assert run.spec.protocol.name == "fedavg"
    assert run.spec.clients.count == 10
    assert run.spec.rounds == 20


def test_parse_manifest_fills_defaults() -> None:
    # Prepare
    document = {
        "apiVersion": "fedcore.dev/v1alpha1",
        "kind": "FederatedRun",
        "metadata": {"name": "minimal"},
        "spec": {"protocol": {"name": "fedsgd"}, "clients": {"count": 4}, "rounds": 1},
    }

    # Execute
    run = parse_manifest(document)

    # Assert
    spec = run.spec
    assert spec.training.batch_size == 32
    assert spec.training.optimizer.learning_rate == 0.1
    assert spec.model.hidden == [128]
    assert spec.model.channels == [16, 32]
    assert spec.clients.per_round == "100%"
    assert spec.clients.sampled_per_round() == 4
    assert spec.data.test_fraction == 0.2
    assert spec.checkpoint.keep_last == 3
    assert spec.privacy is None
    assert spec.protocol.fedsgd.weighting == "ShardSize"
    assert spec.transport.chunk_bytes == 4 * 1024 * 1024


@pytest.mark.parametrize(
    ("value", "total", "expected"),
    [("33%", 10, 4), ("100%", 7, 7), (3, 10, 3), ("1%", 10, 1), ("50%", 5, 3), ("10%", 10, 1)],
)
def test_resolve_share_rounds_up(value: int | str, total: int, expected: int) -> None:
    assert resolve_share(value, total) == expected


def test_resolve_share_refuses_garbage() -> None:
    with pytest.raises(ValueError, match="neither a count nor a percentage"):
        resolve_share("half", 10)


def test_clients_quorum_of_sampled() -> None:
    run = parse_manifest(
        _mutated(
            {
                ("spec", "clients"): {"count": 10, "perRound": "50%", "quorum": "60%"},
            }
        )
    )

    assert run.spec.clients.sampled_per_round() == 5
    assert run.spec.clients.quorum_of(5) == 3


@pytest.mark.parametrize("source", ["base", "example", "full"])
def test_manifest_round_trips(source: str) -> None:
    # Prepare
    if source == "base":
        run = parse_manifest(copy.deepcopy(BASE))
    elif source == "example":
        run = load_manifest(EXAMPLE)
    else:
        run = parse_manifest(
            _mutated(
                {
                    ("metadata", "labels"): {"team": "ml"},
                    ("spec", "privacy"): {"targetDelta": 1e-6, "accountant": "PLD"},
                    ("spec", "clients"): {"count": 8, "perRound": 4, "quorum": "75%"},
                    ("spec", "roles", "clients"): {
                        "gpus": 1,
                        "resources": {"limits": {"memory": "2Gi"}},
                        "tolerations": [
                            {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}
                        ],
                    },
                    ("spec", "data", "partition"): {"kind": "Dirichlet", "alpha": 0.1},
                }
            )
        )

    # Execute
    dumped = run.model_dump(by_alias=True, mode="json", exclude_none=True)
    again = parse_manifest(dumped)

    # Assert
    assert again == run
    assert again.model_dump(by_alias=True, mode="json", exclude_none=True) == dumped


def test_spec_package_does_not_import_torch() -> None:
    code = (
        "import sys, fedcore.spec as s; s.openapi_schema(); s.manifest_reference(); "
        "assert 'torch' not in sys.modules, 'fedcore.spec imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_model_is_frozen() -> None:
    run = parse_manifest(copy.deepcopy(BASE))

    with pytest.raises(ValueError, match="frozen"):
        run.spec.rounds = 5  # type: ignore[misc]
    assert isinstance(run, FederatedRun)


@pytest.mark.parametrize(
    "changes",
    [
        {
            ("spec", "clients"): {"count": 10, "sampling": "Secret"},
            ("spec", "protocol"): {"name": "dp-fedavg"},
            ("spec", "privacy"): {"accountant": "PLD"},
        },
        {
            ("spec", "clients"): {"count": 10, "perRound": 3, "sampling": "Secret"},
            ("spec", "protocol"): {"name": "dp-fedavg"},
            ("spec", "privacy"): {"accountant": "RDP"},
        },
        {
            ("spec", "clients"): {"count": 10, "perRound": 3, "sampling": "Secret"},
            ("spec", "privacy"): {"accountant": "PLD"},
        },
    ],
    ids=["pld-every-client", "rdp-sampled", "pld-without-dp"],
)
def test_a_secret_sample_is_refused_only_where_pld_would_account_it(changes) -> None:
    # Execute
    run = parse_manifest(_mutated(changes))
    # Assert
    assert run.spec.clients.sampling == "Secret"


def test_a_schema_issue_records_its_value_and_what_is_allowed_as_data() -> None:
    # Prepare: a bound, a type and an unknown field
    document = _mutated({("spec", "clients", "count"): 0, ("spec", "rounds"): "20"})
    document["spec"]["trainning"] = {}
    # Execute
    issues = {issue.path: issue for issue in _issues(document)}
    # Assert
    assert (issues["spec.clients.count"].value, issues["spec.clients.count"].allowed) == (
        0,
        "1 to 10000",
    )
    assert (issues["spec.rounds"].value, issues["spec.rounds"].allowed) == ("20", "1 to 1000000")
    unknown = issues["spec.trainning"]
    assert unknown.value is None and unknown.allowed is not None
    assert "training" in unknown.allowed.split(", ")


# ---------------------------------------------------------------------------------- spec.sites

SITES = [{"name": "north", "clients": 6}, {"name": "south", "clients": 4}]
"""BASE's 10 clients spread over two sites."""

OWN_DATA = {
    "clientData": {"format": "Parquet"},
    "schema": {"labelColumn": "y", "labels": ["a", "b"], "features": [{"name": "x"}]},
}
"""Clients' own data that names no source: each site binds its own."""


def _by_path(document: dict[str, Any]) -> dict[str, str]:
    return {issue.path: issue.message for issue in _issues(document)}


def test_sites_that_add_up_to_the_client_count_are_valid() -> None:
    # Execute
    run = parse_manifest(_mutated({("spec", "sites"): copy.deepcopy(SITES)}))
    # Assert
    assert run.spec.sites is not None
    assert [(site.name, site.clients) for site in run.spec.sites] == [("north", 6), ("south", 4)]


def test_sites_whose_clients_do_not_add_up_are_refused_at_spec_sites() -> None:
    # Prepare
    sites = [{"name": "north", "clients": 6}, {"name": "south", "clients": 3}]
    # Execute
    issues = _by_path(_mutated({("spec", "sites"): sites}))
    # Assert
    assert list(issues) == ["spec.sites"]
    assert "the sites run 9 clients but spec.clients.count is 10" in issues["spec.sites"]


def test_a_site_listed_twice_is_refused_at_its_second_name() -> None:
    # Prepare
    sites = [{"name": "north", "clients": 6}, {"name": "north", "clients": 4}]
    # Execute
    issues = _by_path(_mutated({("spec", "sites"): sites}))
    # Assert
    assert list(issues) == ["spec.sites[1].name"]
    assert "'north' is listed twice" in issues["spec.sites[1].name"]


@pytest.mark.parametrize("name", ["North", "1st", "a_b", "ends-", "a" * 41, ""])
def test_a_site_name_that_is_no_dns_label_is_refused(name: str) -> None:
    # Prepare
    sites = [{"name": name, "clients": 6}, {"name": "south", "clients": 4}]
    # Execute
    issues = _by_path(_mutated({("spec", "sites"): sites}))
    # Assert
    assert "spec.sites[0].name" in issues
    assert "is not a site name" in issues["spec.sites[0].name"]


def test_client_data_naming_no_source_needs_sites() -> None:
    # Execute
    issues = _by_path(_mutated({("spec", "data"): copy.deepcopy(OWN_DATA)}))
    # Assert
    assert list(issues) == ["spec.data.clientData"]
    assert "give template or sources: without spec.sites" in issues["spec.data.clientData"]


def test_client_data_naming_no_source_is_valid_with_sites() -> None:
    # Execute
    run = parse_manifest(
        _mutated({("spec", "data"): copy.deepcopy(OWN_DATA), ("spec", "sites"): SITES})
    )
    # Assert
    assert run.spec.data.client_data is not None
    assert run.spec.data.client_data.bound_by_sites


@pytest.mark.parametrize(
    ("own", "path"),
    [
        ({"template": {"path": "/data/{index}"}}, "spec.data.clientData.template"),
        ({"sources": [{"path": f"/data/{i}"} for i in range(10)]}, "spec.data.clientData.sources"),
    ],
    ids=["template", "sources"],
)
def test_client_data_naming_sources_is_refused_with_sites(own: dict[str, Any], path: str) -> None:
    # Prepare
    data = copy.deepcopy(OWN_DATA)
    data["clientData"].update(own)
    # Execute
    issues = _by_path(_mutated({("spec", "data"): data, ("spec", "sites"): SITES}))
    # Assert
    assert list(issues) == [path]
    assert "cannot be set with spec.sites" in issues[path]


def test_site_of_and_site_clients_follow_the_order_of_the_sites() -> None:
    # Prepare
    with_sites = parse_manifest(_mutated({("spec", "sites"): copy.deepcopy(SITES)})).spec
    without = parse_manifest(copy.deepcopy(BASE)).spec
    # Execute / Assert
    assert [with_sites.site_of(index) for index in (0, 5, 6, 9, 10)] == [
        "north",
        "north",
        "south",
        "south",
        None,
    ]
    assert with_sites.site_clients("north") == range(0, 6)
    assert with_sites.site_clients("south") == range(6, 10)
    assert with_sites.site_clients("east") == range(0)
    assert without.site_of(0) is None
    assert without.site_clients("north") == range(0)
