"""The chart's Grafana dashboard and alert rules, proven against promtool and a real Prometheus.

Every panel query, template variable and alert expression runs on a Prometheus that scrapes a
live dp-fedavg `fedcore run` and the operator's real metrics registry; the alerts are also
unit-tested with `promtool test rules`; every metric name they use must exist in the code.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, start_http_server

from fedcore.local.ports import free_port
from fedcore.local.runner import LocalRun
from fedcore.observe.metrics import RoleMetrics
from fedcore.spec import load_manifest
from fedcore_operator.metrics import OperatorMetrics
from tests.integration._prometheus import (
    api,
    log_tail,
    poll,
    promtool_binary,
    query,
    running_prometheus,
)
from tests.integration._runs import write_manifest
from tests.integration.test_local_run import wait_for_event

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "charts" / "fedcore" / "files" / "dashboard.json"
ALERTS = ROOT / "charts" / "fedcore" / "files" / "alerts.yaml"
DOC = ROOT / "docs" / "metrics.md"

RUN = "e2e"
NAMESPACE = "fedcore-test"
OPERATOR_NAMESPACE = "fedcore-system"
ROUNDS = 100_000
BUDGET = 10_000.0
VALUES = {
    "datasource": "prometheus",
    "namespace": NAMESPACE,
    "run": RUN,
    "__rate_interval": "30s",
    "__interval": "15s",
    "__range": "1h",
}
"""What Grafana would put in place of each template variable here."""
ALERT_NAMES = {
    "FedcoreRunStalled",
    "FedcorePrivacyBudgetNearlySpent",
    "FedcoreCheckpointsFailing",
    "FedcoreOperatorErroring",
}
SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "info": ("_info",),
    "summary": ("", "_sum", "_count"),
}
"""The sample names a family of each type exposes, after its family name."""
METRIC = re.compile(r"\bfedcore_[a-z0-9_]+\b")
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")
LABEL_VALUES = re.compile(r"^label_values\((?:(?P<selector>.+),\s*)?(?P<label>\w+)\)$")


# ------------------------------------------------------------------------------- helpers


def dashboard() -> dict[str, Any]:
    """The dashboard JSON of the chart."""
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def alert_rules() -> list[dict[str, Any]]:
    """Every rule of every group of the chart's alert rules."""
    groups = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))["groups"]
    return [rule for group in groups for rule in group["rules"]]


def panel_targets() -> Iterator[tuple[str, str]]:
    """Yields (``panel title/refId``, PromQL) for every target of every panel."""
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            yield f"{panel['title']}/{target['refId']}", target["expr"]


def variable_queries() -> dict[str, str]:
    """The ``label_values(...)`` query of every query-type template variable, by name."""
    found = {}
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            spec = variable["query"]
            found[variable["name"]] = spec["query"] if isinstance(spec, dict) else spec
    return found


def substitute(text: str, **overrides: str) -> str:
    """Replaces Grafana's ``$var``, ``${var}``, ``${var:fmt}`` and ``[[var]]`` with VALUES."""
    values = {**VALUES, **overrides}

    def replace(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group)
        if name not in values:
            raise AssertionError(f"unknown template variable ${name} in {text!r}")
        return values[name]

    return VARIABLE.sub(replace, text)


def exposed_names() -> dict[str, str]:
    """Every sample name the roles and the operator expose, mapped to its family's name.

    Built from the real registries, so that ``_total``, ``_bucket``, ``_sum``, ``_count`` and
    ``_info`` count only on families of the type that exposes them.
    """
    registries: list[CollectorRegistry] = [
        RoleMetrics("run", role).registry for role in ("server", "client", "kdc")
    ]
    registries.append(OperatorMetrics().registry)
    names = {}
    for registry in registries:
        for family in registry.collect():
            for suffix in SUFFIXES[family.type]:
                names[family.name + suffix] = family.name
    return names


def is_operator(promql: str) -> bool:
    """Whether a query reads the operator's metrics (else the roles')."""
    return "fedcore_operator_" in promql


def answer(port: int, promql: str) -> dict[str, Any]:
    """The whole /api/v1/query answer (status, data or error) for a query."""
    return api(port, "query", query=promql)


def render(template: str, labels: Mapping[str, str], value: str) -> str:
    """Renders an alert annotation as Prometheus would, given its labels and ``$value`` text."""
    text = re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)
    return re.sub(r"\{\{\s*\$value[^}]*\}\}", value, text)


def expected_alert(name: str, labels: dict[str, str], value: str) -> dict[str, Any]:
    """One firing alert as `promtool test rules` expects it: labels and rendered annotations."""
    rule = next(rule for rule in alert_rules() if rule["alert"] == name)
    return {
        "exp_labels": {**labels, **rule["labels"]},
        "exp_annotations": {
            key: render(text, labels, value) for key, text in rule["annotations"].items()
        },
    }


# --------------------------------------------------------------------- files, no servers


def test_dashboard_is_valid_and_every_panel_is_complete() -> None:
    # Prepare
    board = dashboard()
    panels = board["panels"]
    # Execute
    ids = [panel.get("id") for panel in panels]
    cells: dict[tuple[int, int], str] = {}
    overlaps = []
    for panel in panels:
        grid = panel["gridPos"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                if (x, y) in cells:
                    overlaps.append((cells[(x, y)], panel["title"]))
                cells[(x, y)] = panel["title"]
    # Assert
    assert board["uid"] == "fedcore-runs" and board["title"] == "fedcore runs"
    assert 36 <= board["schemaVersion"] <= 41
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    assert not overlaps and max(x for x, _ in cells) < 24
    for panel in panels:
        assert panel.get("title"), panel
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel
        targets = panel.get("targets", [])
        assert targets, f"{panel['title']} has no target"
        assert len({t["refId"] for t in targets}) == len(targets), panel["title"]
        assert all(t["expr"].strip() and t["datasource"] == panel["datasource"] for t in targets)


def test_dashboard_template_variables_are_datasource_namespace_and_run() -> None:
    # Prepare
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    # Execute
    queries = variable_queries()
    # Assert
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert set(queries) == {"namespace", "run"}
    assert all(LABEL_VALUES.match(q) for q in queries.values()), queries
    assert variables["namespace"]["datasource"]["uid"] == "${datasource}"
    assert '$namespace"' in queries["run"]
    for title, expr in panel_targets():
        if not is_operator(expr):
            assert 'namespace=~"$namespace"' in expr, title  # every role query honours it


def test_every_metric_the_dashboard_and_alerts_use_exists_in_the_code() -> None:
    # Prepare
    known = exposed_names()
    texts = [expr for _, expr in panel_targets()] + list(variable_queries().values())
    texts += [rule["expr"] for rule in alert_rules()]
    # Execute
    used = {name for text in texts for name in METRIC.findall(text)}
    missing = sorted(used - set(known))
    # Assert
    assert missing == []
    assert len(used) >= 20  # the regex found the names (a guard against a vacuous pass)
    families = {known[name] for name in used}
    assert "fedcore_operator_reconcile_duration_seconds" in families
    assert "fedcore_privacy_epsilon_budget" in families


def test_every_exported_metric_and_alert_is_documented() -> None:
    # Prepare
    text = DOC.read_text(encoding="utf-8")
    # Execute
    families = set(exposed_names().values())
    documented = {
        family
        for family in families
        if any(f"`{family}{suffix}`" in text for suffix in ("", "_total", "_info"))
    }
    # Assert
    assert sorted(families - documented) == []
    assert all(f"`{name}`" in text for name in ALERT_NAMES)


def test_alert_rules_each_have_for_severity_summary_and_description() -> None:
    # Prepare
    rules = alert_rules()
    # Execute
    names = {rule["alert"] for rule in rules}
    # Assert
    assert names == ALERT_NAMES
    for rule in rules:
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


# ---------------------------------------------------------------------------- promtool


def test_promtool_accepts_the_alert_rules_and_refuses_a_broken_copy(tmp_path: Path) -> None:
    # Prepare
    promtool = promtool_binary()
    broken = tmp_path / "broken.yaml"
    text = ALERTS.read_text(encoding="utf-8")
    assert "increase(fedcore_rounds_completed_total" in text
    broken.write_text(text.replace("increase(fedcore_rounds_completed_total", "increase(("))
    # Execute
    good = subprocess.run(
        [promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, check=False
    )
    bad = subprocess.run(
        [promtool, "check", "rules", str(broken)], capture_output=True, text=True, check=False
    )
    # Assert
    assert good.returncode == 0, good.stdout + good.stderr
    assert f"SUCCESS: {len(ALERT_NAMES)} rules found" in good.stdout
    assert bad.returncode != 0
    assert "parse error" in (bad.stdout + bad.stderr)


def series(name: str, values: str, **labels: str) -> dict[str, str]:
    """One input series of a `promtool test rules` file."""
    selector = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    return {"series": f"{name}{{{selector}}}", "values": values}


def test_promtool_unit_tests_fire_each_alert_only_when_it_should(tmp_path: Path) -> None:
    # Prepare: per alert, one series that must fire and others that must stay quiet.
    promtool = promtool_binary()

    def server(run: str) -> dict[str, str]:
        return {"namespace": "ns", "pod": f"{run}-server", "role": "server", "run": run}

    stalled, busy, done, young = server("a"), server("b"), server("c"), server("d")
    near, unbudgeted, far = server("a"), server("b"), server("c")
    op1 = {"namespace": "ops", "pod": "op-1"}
    op2 = {"namespace": "ops", "pod": "op-2"}
    tests = [
        {  # a: no round for an hour, 5 of 20; b: a round a minute; c: finished; d: new, idle
            "interval": "1m",
            "input_series": [
                series("fedcore_rounds_completed_total", "5x60", **stalled),
                series("fedcore_round", "5x60", **stalled),
                series("fedcore_rounds_planned", "20x60", **stalled),
                series("fedcore_rounds_completed_total", "0+1x60", **busy),
                series("fedcore_round", "0+1x60", **busy),
                series("fedcore_rounds_planned", "100x60", **busy),
                series("fedcore_rounds_completed_total", "20x60", **done),
                series("fedcore_round", "20x60", **done),
                series("fedcore_rounds_planned", "20x60", **done),
                series("fedcore_rounds_completed_total", "_x25 0x35", **young),
                series("fedcore_round", "_x25 0x35", **young),
                series("fedcore_rounds_planned", "_x25 20x35", **young),
            ],
            "alert_rule_test": [
                {"eval_time": "35m", "alertname": "FedcoreRunStalled", "exp_alerts": []},
                {
                    "eval_time": "45m",
                    "alertname": "FedcoreRunStalled",
                    "exp_alerts": [expected_alert("FedcoreRunStalled", stalled, "")],
                },
            ],
        },
        {  # a: epsilon 10 + 0.25 a minute of 16; b: DP without a budget; c: far below
            "interval": "1m",
            "input_series": [
                series("fedcore_privacy_epsilon", "10+0.25x30", **near),
                series("fedcore_privacy_epsilon_budget", "16x30", **near),
                series("fedcore_privacy_epsilon", "10+1x30", **unbudgeted),
                series("fedcore_privacy_epsilon_budget", "0x30", **unbudgeted),
                series("fedcore_privacy_epsilon", "1x30", **far),
                series("fedcore_privacy_epsilon_budget", "16x30", **far),
            ],
            "alert_rule_test": [
                {  # 14.5 / 16 at 18m: over 0.9 but not yet for 1m
                    "eval_time": "18m",
                    "alertname": "FedcorePrivacyBudgetNearlySpent",
                    "exp_alerts": [],
                },
                {
                    "eval_time": "20m",
                    "alertname": "FedcorePrivacyBudgetNearlySpent",
                    "exp_alerts": [
                        expected_alert("FedcorePrivacyBudgetNearlySpent", near, "93.75%")
                    ],
                },
            ],
        },
        {  # a: one failed attempt a minute from 11m; b: old failures only
            "interval": "1m",
            "input_series": [
                series("fedcore_checkpoint_failures_total", "0x10 1+1x20", **server("a")),
                series("fedcore_checkpoint_failures_total", "3x30", **server("b")),
            ],
            "alert_rule_test": [
                {"eval_time": "14m", "alertname": "FedcoreCheckpointsFailing", "exp_alerts": []},
                {
                    "eval_time": "20m",
                    "alertname": "FedcoreCheckpointsFailing",
                    "exp_alerts": [
                        expected_alert(
                            "FedcoreCheckpointsFailing",
                            {"namespace": "ns", "role": "server", "run": "a"},
                            "10",
                        )
                    ],
                },
            ],
        },
        {  # op-1: two failed passes a minute; op-2: old errors, passes that change things
            "interval": "1m",
            "input_series": [
                series("fedcore_operator_reconciles_total", "0+2x30", result="error", **op1),
                series("fedcore_operator_reconciles_total", "4x30", result="error", **op2),
                series("fedcore_operator_reconciles_total", "0+5x30", result="changed", **op2),
            ],
            "alert_rule_test": [
                {"eval_time": "8m", "alertname": "FedcoreOperatorErroring", "exp_alerts": []},
                {
                    "eval_time": "20m",
                    "alertname": "FedcoreOperatorErroring",
                    "exp_alerts": [expected_alert("FedcoreOperatorErroring", op1, "33.33m")],
                },
            ],
        },
    ]
    spec = tmp_path / "alerts_test.yaml"
    spec.write_text(
        json.dumps({"rule_files": [str(ALERTS)], "evaluation_interval": "1m", "tests": tests})
    )
    # Execute
    done = subprocess.run(
        [promtool, "test", "rules", str(spec)], capture_output=True, text=True, check=False
    )
    # Assert
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


# ------------------------------------------------------------------------- live Prometheus


def test_prometheus_evaluates_every_panel_variable_and_alert_on_a_live_run(
    tmp_path: Path,
) -> None:
    # Prepare: a dp-fedavg run with a budget and checkpoints, and the operator's registry.
    manifest = write_manifest(
        tmp_path / "run.yaml",
        protocol={
            "name": "dp-fedavg",
            "dpFedavg": {"clippingNorm": 1.0, "noiseMultiplier": 1.0, "secureNoise": False},
        },
        clients={"count": 3, "perRound": 2},
        rounds=ROUNDS,
        privacy={"targetEpsilon": BUDGET, "targetDelta": 1e-5},
        checkpoint={"everyRounds": 2},
    )
    run = LocalRun(load_manifest(manifest), manifest, workdir=tmp_path / "work")
    operator = OperatorMetrics()
    operator.observe_phase(("fedcore-test", RUN), "Running")
    operator.reconciles.labels("changed").inc()
    operator.reconciles.labels("error").inc()
    operator.reconcile_duration.observe(0.02)
    operator.api_writes.labels("patch").inc()
    operator.leader.set(1)
    operator_port = free_port()
    httpd, _ = start_http_server(operator_port, addr="127.0.0.1", registry=operator.registry)
    targets = {f"127.0.0.1:{operator_port}": {"namespace": OPERATOR_NAMESPACE, "pod": "op-0"}}
    panels = list(panel_targets())
    answers: dict[str, dict[str, Any]] = {}
    try:
        run.start()
        wait_for_event(run, "checkpoint", round=2)
        for role, port in run.metrics_ports.items():
            targets[f"127.0.0.1:{port}"] = {"namespace": NAMESPACE, "pod": f"{RUN}-{role}"}
        with running_prometheus(tmp_path, targets) as port:

            def every_panel_has_data() -> bool:
                for title, expr in panels:
                    answers[title] = answer(port, substitute(expr))
                return all(a.get("data", {}).get("result") for a in answers.values()) and all(
                    math.isfinite(float(r["value"][1]))
                    for title in ("Round time/A", "Checkpoint health/A")
                    for r in answers[title]["data"]["result"]
                )

            # Execute
            ready = poll(every_panel_has_data, timeout=120)
            variables = {}
            for name, text in variable_queries().items():
                match = LABEL_VALUES.match(substitute(text, namespace=".*"))
                assert match is not None
                params = {"match[]": match["selector"]} if match["selector"] else {}
                variables[name] = api(port, f"label/{match['label']}/values", **params)
            alerts = {rule["alert"]: answer(port, rule["expr"]) for rule in alert_rules()}
            elsewhere = {
                title: answer(port, substitute(expr, namespace="elsewhere", run="no-such-run"))
                for title, expr in panels
                if not is_operator(expr)
            }
            planned = query(port, f'fedcore_rounds_planned{{role="server", run="{RUN}"}}')
            budget = query(port, f'fedcore_privacy_epsilon_budget{{role="server", run="{RUN}"}}')
            spent = query(port, f'fedcore_privacy_epsilon{{role="server", run="{RUN}"}}')
            accuracy = query(port, f'fedcore_model_accuracy{{role="server", run="{RUN}"}}')
    finally:
        run.stop()
        httpd.shutdown()
    # Assert
    empty = {t: a for t, a in answers.items() if not a.get("data", {}).get("result")}
    assert not empty, f"{empty}\n{log_tail(tmp_path)}"
    assert ready, {t: answers[t] for t in ("Round time/A", "Checkpoint health/A")}
    assert all(a["status"] == "success" for a in answers.values())
    assert variables["namespace"]["status"] == "success"
    assert {NAMESPACE, OPERATOR_NAMESPACE} <= set(variables["namespace"]["data"])
    assert variables["run"]["data"] == [RUN]
    failed = {name: a for name, a in alerts.items() if a.get("status") != "success"}
    assert not failed
    assert all(not a["data"]["result"] for a in alerts.values())  # a healthy run fires none
    leaked = {t: a for t, a in elsewhere.items() if a["status"] != "success" or a["data"]["result"]}
    assert not leaked  # every role query is filtered by $namespace (and $run where it has it)
    assert [float(r["value"][1]) for r in planned] == [ROUNDS]
    assert [float(r["value"][1]) for r in budget] == [BUDGET]
    assert len(spent) == 1 and 0 < float(spent[0]["value"][1]) < BUDGET
    assert len(accuracy) == 1 and 0 < float(accuracy[0]["value"][1]) <= 1
