"""The operator's settings as the chart passes them: NetworkPolicy peers and CA custody."""

from __future__ import annotations

import json

import pytest

from fedcore_operator.settings import ANYWHERE, CLUSTER_DNS, OperatorSettings

SCRAPER = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}


def test_defaults_open_nothing_but_the_cluster_dns() -> None:
    # Execute
    settings = OperatorSettings.from_env({})

    # Assert
    assert settings.metrics_from == ()
    assert settings.dns_to == CLUSTER_DNS
    assert settings.s3_to == ()
    assert settings.api_cidrs == ANYWHERE
    assert settings.ca_namespace == "default"


def test_chart_values_become_settings() -> None:
    # Prepare: what charts/fedcore/templates/deployment.yaml sets
    env = {
        "FEDCORE_OPERATOR_NAMESPACE": "fedcore-system",
        "FEDCORE_OPERATOR_METRICS_FROM": json.dumps([SCRAPER]),
        "FEDCORE_OPERATOR_DNS_TO": json.dumps([{"podSelector": {"matchLabels": {"a": "b"}}}]),
        "FEDCORE_OPERATOR_S3_TO": json.dumps([{"ipBlock": {"cidr": "52.216.0.0/15"}}]),
        "FEDCORE_OPERATOR_API_PORTS": "6443",
        "FEDCORE_OPERATOR_API_CIDRS": "10.0.0.1/32, fd00::1/128",
    }

    # Execute
    settings = OperatorSettings.from_env(env)

    # Assert
    assert settings.ca_namespace == "fedcore-system"
    assert settings.metrics_from == (SCRAPER,)
    assert settings.dns_to == ({"podSelector": {"matchLabels": {"a": "b"}}},)
    assert settings.s3_to == ({"ipBlock": {"cidr": "52.216.0.0/15"}},)
    assert settings.api_ports == (6443,)
    assert settings.api_cidrs == ("10.0.0.1/32", "fd00::1/128")


BAD = [
    ("FEDCORE_OPERATOR_METRICS_FROM", "{not json", "FEDCORE_OPERATOR_METRICS_FROM: not JSON"),
    ("FEDCORE_OPERATOR_METRICS_FROM", json.dumps(SCRAPER), "must be a JSON list"),
    ("FEDCORE_OPERATOR_S3_TO", json.dumps([{"cidr": "1.2.3.4/32"}]), "FEDCORE_OPERATOR_S3_TO[0]"),
    ("FEDCORE_OPERATOR_S3_TO", json.dumps([{}]), "FEDCORE_OPERATOR_S3_TO[0]"),
    (
        "FEDCORE_OPERATOR_S3_TO",
        json.dumps([{"ipBlock": {"cidr": "example.com/8"}}]),
        "'example.com/8' is not a CIDR",
    ),
    ("FEDCORE_OPERATOR_DNS_TO", "[]", "would open DNS to every address"),
    ("FEDCORE_OPERATOR_API_CIDRS", "0.0.0.0/0,everywhere", "'everywhere' is not a CIDR"),
]


@pytest.mark.parametrize(("name", "value", "message"), BAD, ids=[b[2] for b in BAD])
def test_a_bad_setting_is_refused_naming_it(name: str, value: str, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        OperatorSettings.from_env({name: value})
    assert message in str(caught.value)
