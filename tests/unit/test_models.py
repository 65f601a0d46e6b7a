"""Tests of fedcore.learning.models: the model zoo and the weight round trip."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fedcore.learning.data import load_split
from fedcore.learning.models import build_model, get_weights, model_bytes, set_weights
from fedcore.spec import DataSourceSpec, DataSpec, ModelSpec


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    """Whether two weight dicts have the same names and values."""
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------ build_model


def test_build_model_mlp_layers_and_output_shape() -> None:
    # Prepare
    spec = ModelSpec(kind="MLP", hidden=[32, 16], activation="Tanh", bias=False)

    # Execute
    model = build_model(spec, (1, 8, 8), 10, seed=0)
    out = model(torch.zeros(5, 1, 8, 8))

    # Assert
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(64, 32), (32, 16), (16, 10)]
    assert all(m.bias is None for m in linears)
    assert sum(isinstance(m, nn.Tanh) for m in model.modules()) == 2
    assert out.shape == (5, 10)


def test_build_model_mlp_without_hidden_is_linear() -> None:
    # Prepare
    spec = ModelSpec(kind="MLP", hidden=[])

    # Execute
    model = build_model(spec, (3,), 2, seed=0)

    # Assert
    assert list(get_weights(model)) == ["1.weight", "1.bias"]
    assert model(torch.zeros(4, 3)).shape == (4, 2)


def test_build_model_cnn_forward_on_digits() -> None:
    # Prepare
    train, _ = load_split(DataSpec())
    spec = ModelSpec(kind="CNN", channels=[8, 16])
    model = build_model(spec, train.input_shape, train.num_classes, seed=0)

    # Execute
    out = model(torch.from_numpy(train.x[:6].copy()))

    # Assert
    assert out.shape == (6, 10)
    assert sum(isinstance(m, nn.MaxPool2d) for m in model.modules()) == 2


def test_build_model_cnn_forward_on_mnist() -> None:
    # Prepare
    train, _ = load_split(DataSpec(source=DataSourceSpec(kind="MNISTSubset")))
    spec = ModelSpec(kind="CNN", channels=[4, 8])
    model = build_model(spec, train.input_shape, train.num_classes, seed=0)

    # Execute
    out = model(torch.from_numpy(train.x[:3].copy()))

    # Assert
    assert out.shape == (3, 10)
    head = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    assert head.in_features == 8 * 7 * 7


def test_build_model_cnn_skips_pool_at_size_one() -> None:
    # Prepare
    spec = ModelSpec(kind="CNN", channels=[2, 2, 2, 2, 2])

    # Execute
    model = build_model(spec, (1, 8, 8), 3, seed=0)

    # Assert
    assert sum(isinstance(m, nn.MaxPool2d) for m in model.modules()) == 3
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 3)


def test_build_model_cnn_refuses_flat_input() -> None:
    # Prepare
    spec = ModelSpec(kind="CNN")

    # Execute / Assert
    with pytest.raises(ValueError, match=r"CNN needs examples of shape .* got \(64,\)"):
        build_model(spec, (64,), 10, seed=0)


def test_build_model_init_deterministic_per_seed() -> None:
    # Prepare
    spec = ModelSpec(kind="CNN")

    # Execute
    first = get_weights(build_model(spec, (1, 8, 8), 10, seed=7))
    again = get_weights(build_model(spec, (1, 8, 8), 10, seed=7))
    other = get_weights(build_model(spec, (1, 8, 8), 10, seed=8))

    # Assert
    assert _same(first, again)
    assert not any(np.array_equal(first[k], other[k]) for k in first if k.endswith("weight"))


def test_build_model_leaves_global_rng_untouched() -> None:
    # Prepare
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)

    # Execute
    build_model(ModelSpec(), (1, 8, 8), 10, seed=0)
    drawn = torch.rand(3)

    # Assert
    assert torch.equal(drawn, expected)


def test_build_model_float64() -> None:
    # Prepare
    spec = ModelSpec(kind="MLP", dtype="float64")

    # Execute
    model = build_model(spec, (1, 8, 8), 10, seed=0)
    out = model(torch.zeros(2, 1, 8, 8, dtype=torch.float64))

    # Assert
    assert all(w.dtype == np.float64 for w in get_weights(model).values())
    assert out.dtype == torch.float64


def test_build_model_import_calls_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare
    (tmp_path / "fc_user_model_ok.py").write_text(
        textwrap.dedent(
            """
            import math
            from torch import nn

            def make(input_shape, num_classes):
                return nn.Sequential(
                    nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes)
                )
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = ModelSpec(kind="Import", import_path="fc_user_model_ok:make", dtype="float64")

    # Execute
    first = build_model(spec, (2, 3), 4, seed=1)
    again = build_model(spec, (2, 3), 4, seed=1)

    # Assert
    assert first(torch.zeros(5, 2, 3, dtype=torch.float64)).shape == (5, 4)
    assert _same(get_weights(first), get_weights(again))
    assert get_weights(first)["1.weight"].dtype == np.float64


@pytest.mark.parametrize(
    "spec",
    [
        ModelSpec(kind="MLP", hidden=[32, 16]),
        ModelSpec(kind="MLP", hidden=[8], bias=False, dtype="float64"),
        ModelSpec(kind="CNN", channels=[4, 8]),
    ],
    ids=["mlp", "mlp-float64", "cnn"],
)
def test_model_bytes_are_the_built_models_weights(spec: ModelSpec) -> None:
    # Prepare
    built = build_model(spec, (1, 8, 8), 10, seed=0)
    expected = sum(array.nbytes for array in get_weights(built).values())

    # Execute / Assert
    assert model_bytes(spec, (1, 8, 8), 10) == expected


@pytest.mark.parametrize(
    "model",
    [
        {"kind": "MLP", "hidden": [32, 16]},
        {"kind": "MLP", "hidden": [], "bias": False, "dtype": "float64"},
        {"kind": "CNN", "channels": [4, 8]},
        {"kind": "CNN", "channels": [3, 5, 7, 9], "bias": False},
    ],
    ids=["mlp", "linear-float64", "cnn", "cnn-deep-no-bias"],
)
@pytest.mark.parametrize("source", ["Digits", "MNISTSubset"])
def test_the_runner_sizes_built_in_models_as_the_zoo_builds_them(model: dict, source: str) -> None:
    # Prepare
    from fedcore.learning.data import dataset_info
    from fedcore.local.probe import builtin_model_bytes
    from fedcore.spec import parse_manifest

    run = parse_manifest(
        {
            "apiVersion": "fedcore.dev/v1alpha1",
            "kind": "FederatedRun",
            "metadata": {"name": "sizes"},
            "spec": {
                "protocol": {"name": "fedavg"},
                "model": model,
                "data": {"source": {"kind": source}},
                "clients": {"count": 2},
                "rounds": 1,
            },
        }
    )
    built = build_model(run.spec.model, *dataset_info(run.spec), seed=0)

    # Execute / Assert
    assert builtin_model_bytes(run.spec) == sum(a.nbytes for a in get_weights(built).values())


def test_the_runner_sizes_a_built_in_model_on_clients_own_data_from_the_schema() -> None:
    # Prepare: the hospitals' Parquet tables, whose shape the schema states
    from fedcore.learning.data import dataset_info
    from fedcore.local.probe import builtin_model_bytes
    from fedcore.spec import load_manifest

    run = load_manifest(Path(__file__).resolve().parents[2] / "examples/hospitals-tabular.yaml")
    built = build_model(run.spec.model, *dataset_info(run.spec), seed=0)

    # Execute / Assert
    assert run.spec.data.client_data is not None
    assert builtin_model_bytes(run.spec) == sum(a.nbytes for a in get_weights(built).values())


def test_model_bytes_of_a_huge_user_model_take_no_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: 16 billion parameters (64 GB in float32, more than this machine has), with a
    # buffer, built by a factory as a user writes one (torch.zeros, default init)
    import resource

    (tmp_path / "fc_user_model_huge.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            class Huge(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.layers = nn.ModuleList(nn.Linear(16384, 16384) for _ in range(60))
                    self.register_buffer("scale", torch.zeros(1000))

            def make(input_shape, num_classes):
                return Huge()
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = ModelSpec(kind="Import", import_path="fc_user_model_huge:make")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB

    # Execute
    found = model_bytes(spec, (1, 8, 8), 10)

    # Assert
    assert found == 4 * (60 * (16384 * 16384 + 16384) + 1000)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < 256 * 1024, f"the peak grew {grown} KiB"


def test_build_model_import_refuses_non_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    (tmp_path / "fc_user_model_bad.py").write_text("def make(shape, k):\n    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = ModelSpec(kind="Import", import_path="fc_user_model_bad:make")

    # Execute / Assert
    with pytest.raises(ValueError, match=r"importPath 'fc_user_model_bad:make' returned a int"):
        build_model(spec, (3,), 2, seed=0)


def test_build_model_import_refuses_missing_module() -> None:
    # Prepare
    spec = ModelSpec(kind="Import", import_path="fc_no_such_module_here:make")

    # Execute / Assert
    with pytest.raises(ValueError, match=r"importPath 'fc_no_such_module_here:make' cannot be"):
        build_model(spec, (3,), 2, seed=0)


# -------------------------------------------------------------------------------- weights


def test_get_weights_returns_copies_in_state_dict_order() -> None:
    # Prepare
    model = build_model(ModelSpec(hidden=[4]), (3,), 2, seed=0)

    # Execute
    weights = get_weights(model)
    weights["1.weight"][:] = 99.0

    # Assert
    assert list(weights) == list(model.state_dict())
    assert not torch.any(model.state_dict()["1.weight"] == 99.0)


def test_set_weights_round_trip() -> None:
    # Prepare
    source = build_model(ModelSpec(kind="CNN", channels=[3]), (1, 4, 4), 2, seed=1)
    target = build_model(ModelSpec(kind="CNN", channels=[3]), (1, 4, 4), 2, seed=2)
    weights = get_weights(source)

    # Execute
    set_weights(target, weights)

    # Assert
    assert _same(get_weights(target), weights)
    x = torch.randn(2, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(source(x), target(x))


def test_set_weights_accepts_reversed_arrays() -> None:
    # Prepare
    model = build_model(ModelSpec(hidden=[4]), (3,), 2, seed=0)
    changed = {k: v + 1 for k, v in get_weights(model).items()}
    reversed_views = {k: v[::-1] for k, v in changed.items()}

    # Execute
    set_weights(model, reversed_views)

    # Assert
    assert _same(get_weights(model), reversed_views)


def test_set_weights_accepts_read_only_arrays() -> None:
    # Prepare
    model = build_model(ModelSpec(hidden=[4]), (3,), 2, seed=0)
    changed = {k: v + 1 for k, v in get_weights(model).items()}
    frozen = {
        k: np.frombuffer(v.tobytes(), dtype=v.dtype).reshape(v.shape) for k, v in changed.items()
    }

    # Execute
    set_weights(model, frozen)

    # Assert
    assert not any(v.flags.writeable for v in frozen.values())
    assert _same(get_weights(model), changed)


def test_set_weights_refuses_missing_name() -> None:
    # Prepare
    model = build_model(ModelSpec(hidden=[4]), (3,), 2, seed=0)
    weights = get_weights(model)
    del weights["3.bias"]

    # Execute / Assert
    with pytest.raises(ValueError, match=r"missing \['3.bias'\], unexpected \[\]"):
        set_weights(model, weights)


def test_set_weights_refuses_shape_mismatch_and_keeps_model() -> None:
    # Prepare
    model = build_model(ModelSpec(hidden=[4]), (3,), 2, seed=0)
    before = get_weights(model)
    weights = {k: v + 1 for k, v in before.items()}
    weights["3.weight"] = np.zeros((3, 4), dtype=np.float32)

    # Execute / Assert
    with pytest.raises(ValueError, match=r"'3.weight' has shape \(3, 4\).*shape \(2, 4\)"):
        set_weights(model, weights)
    assert _same(get_weights(model), before)


def test_set_weights_refuses_dtype_mismatch() -> None:
    # Prepare
    model = build_model(ModelSpec(hidden=[4]), (3,), 2, seed=0)
    weights = {k: v.astype(np.float64) for k, v in get_weights(model).items()}

    # Execute / Assert
    with pytest.raises(ValueError, match=r"'1.weight' .* dtype float64.* dtype float32"):
        set_weights(model, weights)


def test_set_weights_does_not_alias_input() -> None:
    # Prepare
    model = build_model(ModelSpec(hidden=[4]), (3,), 2, seed=0)
    weights = get_weights(model)
    kept = {k: v.copy() for k, v in weights.items()}

    # Execute
    set_weights(model, weights)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)

    # Assert
    assert _same(weights, kept)
