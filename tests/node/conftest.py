"""Fixtures: one control plane and one real node (containerd, kubelet, kube-proxy) for the tier.

`bash hack/test.sh` installs and builds what they need and sets FEDCORE_REQUIRE_REAL_NODE=1,
so there a missing piece fails the tier. Elsewhere (not root, no containerd) it is skipped
with what is missing.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._marks import mark_folder
from tests.kube.cluster import ControlPlane
from tests.node.node import PodNetwork, RealNode, missing_requirements

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/node is an integration test."""
    mark_folder(items, HERE, pytest.mark.integration)


@pytest.fixture(scope="package")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNode]:
    """A control plane on a pod network's gateway and one real node on that network, for the
    tests under tests/node only: stopped (its images and snapshots, several GB, removed) as
    soon as they are done, not at the end of the whole suite."""
    missing = missing_requirements()
    if missing:
        message = f"a real node needs {', '.join(missing)} (bash hack/test.sh provides them)"
        if os.environ.get("FEDCORE_REQUIRE_REAL_NODE"):
            pytest.fail(message)
        pytest.skip(message)
    network = PodNetwork().create()
    try:
        plane = ControlPlane(
            workdir=tmp_path_factory.mktemp("node-plane"), advertise_address=network.gateway
        )
        with plane, RealNode(plane, network, workdir=tmp_path_factory.mktemp("node")) as real:
            yield real
    finally:
        network.remove()


@pytest.fixture
def node_namespace(node: RealNode) -> Iterator[str]:
    """A fresh namespace on the real node's cluster, deleted after the test."""
    name = node.control_plane.create_namespace(f"n-{uuid.uuid4().hex[:10]}")
    yield name
    node.control_plane.delete_namespace(name, wait=60)
