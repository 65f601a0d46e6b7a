"""Fixtures: one real control plane and one fake kubelet per pytest session, a namespace per test.

The control plane needs the binaries `bash hack/control-plane.sh` builds (or
``$FEDCORE_TEST_KUBECONFIG``); without them the fixture raises and says so.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._marks import mark_folder
from tests.kube.cluster import ControlPlane
from tests.kube.kubelet import FakeKubelet

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/kube is an integration test."""
    mark_folder(items, HERE, pytest.mark.integration)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd + kube-apiserver + controller-manager + scheduler, with two fake nodes.

    ``fake-node-0`` (16 cpu, 64Gi) and ``fake-gpu-node-0`` (also 4 nvidia.com/gpu).
    """
    plane = ControlPlane(workdir=tmp_path_factory.mktemp("control-plane"))
    plane.start()
    try:
        plane.register_nodes(1)
        plane.register_nodes(1, gpus=4)
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def kubelet(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FakeKubelet]:
    """The fake kubelet of both fake nodes: pods bound to them run as local processes."""
    with FakeKubelet(
        control_plane, control_plane.nodes, workdir=tmp_path_factory.mktemp("kubelet")
    ) as fake:
        yield fake


@pytest.fixture
def namespace(control_plane: ControlPlane) -> Iterator[str]:
    """A fresh namespace, deleted after the test (its pods get graceful deletion)."""
    name = control_plane.create_namespace(f"t-{uuid.uuid4().hex[:10]}")
    yield name
    control_plane.delete_namespace(name)


@pytest.fixture(scope="module")
def hospitals(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The hospitals example's tables (examples/make_data.py): ``hospital-<i>`` folders."""
    out = tmp_path_factory.mktemp("data")
    subprocess.run(
        [sys.executable, str(HERE.parents[1] / "examples" / "make_data.py"), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    return out / "hospitals"
