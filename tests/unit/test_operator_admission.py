"""The validating webhook's rules, as pure functions (the real webhook is tested in tests/kube)."""

from __future__ import annotations

from typing import Any

import pytest

from fedcore.errors import SpecError
from fedcore.spec import parse_manifest
from fedcore.spec._pod_security import APPARMOR_PREFIX
from fedcore_operator import admission
from fedcore_operator.conditions import differs, set_condition


def run(name: str = "demo", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "fedcore.dev/v1alpha1",
        "kind": "FederatedRun",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"protocol": {"name": "fedavg"}, "clients": {"count": 4}, "rounds": 3},
    }
    body["spec"].update(spec)
    return body


def test_a_valid_run_is_admitted() -> None:
    assert admission.check(run(), None, "CREATE") == []


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (run(protocol={"name": "perturb"}), "spec.model"),
        (run(clients={"count": 4, "quorum": 9}), "spec.clients.quorum"),
        (run("9lives"), "metadata.name: '9lives' is not allowed: a run's name must start"),
        (run("a" * 50, clients={"count": 1000}), "is too long for 1000 clients"),
        (
            run(roles={"server": {"podTemplate": {"spec": {"hostNetwork": True}}}}),
            "spec.roles.server.podTemplate.spec.hostNetwork",
        ),
        (
            run(
                roles={
                    "clients": {
                        "podTemplate": {
                            "spec": {
                                "containers": [
                                    {"name": "fedcore", "securityContext": {"privileged": True}}
                                ]
                            }
                        }
                    }
                }
            ),
            "spec.roles.clients.podTemplate.spec.containers[0].securityContext.privileged",
        ),
        (
            run(roles={"kdc": {"podTemplate": {"spec": {"securityContext": {"runAsUser": 0}}}}}),
            "runAsUser 0",
        ),
    ],
)
def test_invalid_runs_are_refused_naming_the_field(body: dict[str, Any], expected: str) -> None:
    problems = admission.check(body, None, "CREATE")
    assert any(expected in problem for problem in problems), problems


def test_a_field_beside_spec_is_refused_and_server_fields_are_not() -> None:
    # Prepare: what the API server adds, and a label misplaced beside spec (the CRD keeps it).
    body = run()
    body["metadata"].update(uid="1234", generation=1, managedFields=[{"manager": "kubectl"}])
    body["status"] = {"phase": "Pending"}
    misplaced = {**body, "labels": {"team": "a"}}

    # Execute
    admitted = admission.check(body, None, "CREATE")
    refused = admission.check(misplaced, None, "CREATE")

    # Assert
    assert admitted == []
    assert refused == [
        "labels: unknown field; allowed fields here: apiVersion, kind, metadata, spec, status."
    ]


def test_the_webhook_refuses_with_the_local_message() -> None:
    # Prepare
    body = run(training={"optimizer": {"lerningRate": 0.1}})

    # Execute
    problems = admission.check(body, None, "CREATE")

    # Assert
    with pytest.raises(SpecError) as local:
        parse_manifest(body)
    assert problems == [str(issue) for issue in local.value.issues]


def with_status(body: dict[str, Any], phase: str) -> dict[str, Any]:
    return {**body, "status": {"phase": phase}}


def test_running_run_may_only_change_suspend_deadline_and_backoff() -> None:
    old = with_status(run(), "Running")
    assert admission.check(run(suspend=True, backoffLimit=2), old, "UPDATE") == []
    problems = admission.check(run(rounds=9), old, "UPDATE")
    assert len(problems) == 1
    assert problems[0].startswith("spec.rounds: cannot change while the run is Running")
    assert "suspend it first" in problems[0]


def test_suspended_run_may_change_resume_insensitive_fields_only() -> None:
    old = with_status(run(suspend=True), "Suspended")
    assert admission.check(run(suspend=True, rounds=9), old, "UPDATE") == []
    problems = admission.check(run(suspend=True, clients={"count": 5}), old, "UPDATE")
    assert problems and problems[0].startswith("spec.clients: cannot change")


def test_finished_run_spec_is_frozen_but_metadata_may_change() -> None:
    old = with_status(run(), "Succeeded")
    assert admission.check(run(), old, "UPDATE") == []
    assert admission.check(run(rounds=4), old, "UPDATE") == [
        "spec.rounds: the run has succeeded; its spec can no longer change (create a new run)."
    ]


def test_condition_time_changes_only_with_its_status() -> None:
    first = set_condition([], "Ready", False, "Waiting", "x", 1)
    same = set_condition(
        [{**first[0], "lastTransitionTime": "2020-01-01T00:00:00Z"}], "Ready", False, "W", "y", 2
    )
    assert same[0]["lastTransitionTime"] == "2020-01-01T00:00:00Z"
    assert same[0]["observedGeneration"] == 2
    flipped = set_condition(same, "Ready", True, "Up", "z", 2)
    assert flipped[0]["lastTransitionTime"] != "2020-01-01T00:00:00Z"
    assert flipped[0]["status"] == "True"


def test_differs_ignores_fields_the_server_added() -> None:
    desired = {"spec": {"ports": [{"port": 1, "name": "a"}], "selector": {"x": "1"}}}
    actual = {
        "spec": {
            "ports": [{"port": 1, "name": "a", "targetPort": 1}],
            "selector": {"x": "1"},
            "clusterIP": "10.0.0.3",
        }
    }
    assert not differs(desired, actual)
    assert differs(desired, {"spec": {"ports": [], "selector": {"x": "1"}}})
    assert differs({"data": {"a": "1"}}, {"data": {"a": "2"}})


def template_run(role: str, template: dict[str, Any]) -> dict[str, Any]:
    return run(roles={role: {"podTemplate": template}})


WEAKENING_TEMPLATES = [
    pytest.param(
        {"spec": {"initContainers": [{"name": "x", "securityContext": {"privileged": True}}]}},
        "spec.initContainers[0].securityContext.privileged: must be false",
        id="privileged-init-container",
    ),
    pytest.param(
        {"spec": {"initContainers": [{"name": "x", "securityContext": {"runAsUser": 0}}]}},
        "spec.initContainers[0].securityContext.runAsUser: 0 (root) is refused",
        id="root-init-container",
    ),
    pytest.param(
        {
            "spec": {
                "ephemeralContainers": [{"name": "x", "securityContext": {"runAsNonRoot": False}}]
            }
        },
        "spec.ephemeralContainers[0].securityContext.runAsNonRoot: must be true",
        id="ephemeral-container-as-root",
    ),
    pytest.param(
        {
            "spec": {
                "containers": [
                    {"name": "fedcore", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}
                ]
            }
        },
        "spec.containers[0].securityContext.capabilities.add: ['SYS_ADMIN'] is refused",
        id="added-capability",
    ),
    pytest.param(
        {
            "spec": {
                "initContainers": [
                    {"name": "x", "securityContext": {"allowPrivilegeEscalation": True}}
                ]
            }
        },
        "spec.initContainers[0].securityContext.allowPrivilegeEscalation: must be false",
        id="privilege-escalation",
    ),
    pytest.param(
        {"spec": {"securityContext": {"seccompProfile": {"type": "Unconfined"}}}},
        "spec.securityContext.seccompProfile.type: 'Unconfined' is refused",
        id="pod-seccomp-unconfined",
    ),
    pytest.param(
        {
            "spec": {
                "containers": [
                    {
                        "name": "fedcore",
                        "securityContext": {"seccompProfile": {"type": "Unconfined"}},
                    }
                ]
            }
        },
        "spec.containers[0].securityContext.seccompProfile.type: 'Unconfined' is refused",
        id="container-seccomp-unconfined",
    ),
    pytest.param(
        {"metadata": {"annotations": {APPARMOR_PREFIX + "fedcore": "unconfined"}}},
        "metadata.annotations." + APPARMOR_PREFIX + "fedcore: 'unconfined' is refused",
        id="apparmor-unconfined",
    ),
    pytest.param(
        {"spec": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}},
        "spec.volumes[0].hostPath: may not be set",
        id="host-path",
    ),
    pytest.param(
        {"spec": {"volumes": [{"name": "ca", "secret": {"secretName": "demo-ca"}}]}},
        "spec.volumes[0].secret: may not be set",
        id="the-run-ca-secret",
    ),
    pytest.param(
        {"spec": {"volumes": [{"name": "c", "configMap": {"name": "other"}}]}},
        "spec.volumes[0].configMap: may not be set",
        id="a-foreign-config-map",
    ),
    pytest.param(
        {"spec": {"volumes": [{"name": "p", "projected": {"sources": []}}]}},
        "spec.volumes[0].projected: may not be set",
        id="projected",
    ),
    pytest.param(
        {"spec": {"nodeName": "node-1"}},
        "spec.nodeName: may not be set",
        id="node-name",
    ),
    pytest.param(
        {"spec": {"hostPID": True}},
        "spec.hostPID: may not be set",
        id="host-pid",
    ),
    pytest.param(
        {"spec": {"automountServiceAccountToken": True}},
        "spec.automountServiceAccountToken: may not be true: the clients role has no API access",
        id="token-for-a-client",
    ),
    pytest.param(
        {
            "spec": {
                "containers": [
                    {
                        "name": "fedcore",
                        "env": [
                            {"name": "A", "value": "1"},
                            {
                                "name": "KEY",
                                "valueFrom": {
                                    "secretKeyRef": {"name": "demo-server-keys", "key": "k"}
                                },
                            },
                        ],
                    }
                ]
            }
        },
        "spec.containers[0].env[1].valueFrom.secretKeyRef: may not be set",
        id="env-from-another-roles-secret",
    ),
    pytest.param(
        {"spec": {"initContainers": [{"name": "x", "envFrom": [{"secretRef": {"name": "s"}}]}]}},
        "spec.initContainers[0].envFrom[0].secretRef: may not be set",
        id="env-from-a-whole-secret",
    ),
    pytest.param(
        {"spec": {"containers": [{"name": "fedcore", "ports": [{"hostPort": 22}]}]}},
        "spec.containers[0].ports[0].hostPort: may not be set",
        id="host-port",
    ),
]


@pytest.mark.parametrize(("template", "expected"), WEAKENING_TEMPLATES)
def test_a_template_that_weakens_a_pod_is_refused_naming_the_field(
    template: dict[str, Any], expected: str
) -> None:
    # Execute
    problems = admission.check(template_run("clients", template), None, "CREATE")
    # Assert
    assert any(f"spec.roles.clients.podTemplate.{expected}" in p for p in problems), problems


def test_the_issues_hostile_template_is_refused_on_every_count() -> None:
    # Prepare: issue 19's template, which passed admission and reached the pods unchanged
    template = {
        "spec": {
            "initContainers": [
                {
                    "name": "x",
                    "securityContext": {
                        "privileged": True,
                        "runAsUser": 0,
                        "capabilities": {"add": ["SYS_ADMIN"]},
                        "seccompProfile": {"type": "Unconfined"},
                    },
                }
            ],
            "volumes": [
                {"name": "root", "hostPath": {"path": "/"}},
                {"name": "ca", "secret": {"secretName": "demo-ca"}},
            ],
        }
    }
    # Execute
    problems = admission.check(template_run("server", template), None, "CREATE")
    # Assert: six problems, each on its own field
    base = "spec.roles.server.podTemplate.spec."
    assert sorted(p.split(":")[0] for p in problems) == sorted(
        [
            base + "initContainers[0].securityContext.privileged",
            base + "initContainers[0].securityContext.runAsUser",
            base + "initContainers[0].securityContext.capabilities.add",
            base + "initContainers[0].securityContext.seccompProfile.type",
            base + "volumes[0].hostPath",
            base + "volumes[1].secret",
        ]
    )


def test_safe_templates_are_admitted() -> None:
    # Prepare: what a run's author may legitimately set
    template = {
        "metadata": {"labels": {"team": "a"}, "annotations": {"owner": "b"}},
        "spec": {
            "priorityClassName": "high",
            "automountServiceAccountToken": False,
            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {
                    "name": "fedcore",
                    "env": [{"name": "X", "value": "1"}],
                    "securityContext": {
                        "capabilities": {"drop": ["ALL"]},
                        "readOnlyRootFilesystem": True,
                    },
                }
            ],
            "volumes": [{"name": "scratch", "emptyDir": {}}],
        },
    }
    # Execute / Assert
    for role in ("kdc", "server", "clients"):
        assert admission.check(template_run(role, template), None, "CREATE") == []
    server = template_run("server", {"spec": {"automountServiceAccountToken": True}})
    assert admission.check(server, None, "CREATE") == []


# ---------------------------------------------------------------------------- participations


def participation(name: str = "study", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "fedcore.dev/v1alpha1",
        "kind": "Participation",
        "metadata": {"name": name, "namespace": "research", "uid": "u", "generation": 3},
        "spec": {
            "run": "consortium",
            "specDigest": "sha256:" + "ab" * 32,
            "clients": 2,
            "floor": {"protocols": ["dp-fedavg"], "maxEpsilon": 8.0},
            "images": ["registry.example.org/fedcore/"],
        },
        "status": {"phase": "Running", "unknownToTheModel": True},
    }
    body["spec"].update(spec)
    return body


def test_a_valid_participation_is_admitted_whatever_its_status_says() -> None:
    assert admission.check_participation(participation()) == []


@pytest.mark.parametrize(
    ("name", "admitted"),
    [("study", True), ("s-7", True), ("7study", False), ("bad.name", False), ("a" * 64, False)],
)
def test_a_participation_name_must_be_a_label_that_starts_with_a_letter(
    name: str, admitted: bool
) -> None:
    problems = admission.check_participation(participation(name))
    assert (problems == []) == admitted
    if not admitted:
        assert problems == [
            f"metadata.name: {name!r} must be a DNS label that starts with a letter (lowercase "
            "letters, digits and '-', at most 63 characters): it labels the objects it owns"
        ]


def test_each_problem_of_a_participation_is_named_by_its_field() -> None:
    body = participation(withdrawm=True, images=["evil:latest"], clients=0)
    body["spec"]["floor"]["maxEpsilon"] = -1
    problems = admission.check_participation(body)
    assert sorted(problem.split(":")[0] for problem in problems) == [
        "spec.clients",
        "spec.floor.maxEpsilon",
        "spec.images",
        "spec.withdrawm",
    ]
    assert (
        "spec.withdrawm: unknown field; allowed fields here: clients, data, floor, images, "
        "pods, run, specDigest, withdrawn." in problems
    )
    assert any("'evil:latest' is neither an image by digest" in p for p in problems)


def test_a_participation_of_another_kind_or_version_is_refused() -> None:
    body = participation()
    body["kind"] = "SitePolicy"
    body["apiVersion"] = "fedcore.dev/v1"
    problems = admission.check_participation(body)
    assert sorted(problem.split(":")[0] for problem in problems) == ["apiVersion", "kind"]
