"""Clients' own data (spec.data.clientData): every format read end to end, checked against the
schema where the data is, split, cached; and the refusals, each naming the client and what is
wrong without a data value."""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from PIL import Image

from fedcore.errors import DataError, SpecError
from fedcore.learning.data import _cache, _own, client_dataset, client_test_dataset, own_data
from fedcore.learning.data._sources import shuffle_split
from fedcore.spec import FederatedRun, parse_manifest

SECRET = 7919.25
"""A feature value that must never appear in a message."""


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Each test its own cache folder and no data loaded before."""
    folder = tmp_path / "cache"
    monkeypatch.setenv(_cache.CACHE_ENV, str(folder))
    _own._LOADED.clear()
    yield folder
    _own._LOADED.clear()


def document(
    data_format: str, source: dict[str, Any], schema: dict[str, Any], **data: Any
) -> dict[str, Any]:
    """A two-client manifest whose clients read ``source`` (a template) in ``data_format``."""
    return {
        "apiVersion": "fedcore.dev/v1alpha1",
        "kind": "FederatedRun",
        "metadata": {"name": "own-data"},
        "spec": {
            "protocol": {"name": "fedavg"},
            "data": {
                "clientData": {"format": data_format, "template": source},
                "schema": schema,
                **data,
            },
            "clients": {"count": 2},
            "rounds": 1,
        },
    }


def manifest(data_format: str, path: str, schema: dict[str, Any], **data: Any) -> FederatedRun:
    return parse_manifest(document(data_format, {"path": path}, schema, **data))


TABLE_SCHEMA = {
    "labelColumn": "diagnosis",
    "labels": ["malignant", "benign"],
    "features": [
        {"name": "radius", "center": 10.0, "scale": 2.0},
        {"name": "age", "type": "int64"},
    ],
}


def table(rows: int, seed: int, *, extra: bool = True) -> pa.Table:
    rng = np.random.default_rng(seed)
    columns: dict[str, Any] = {
        "radius": pa.array(rng.normal(10, 2, rows)),
        "age": pa.array(rng.integers(20, 90, rows), type=pa.int64()),
        "diagnosis": pa.array(rng.choice(["malignant", "benign"], rows).tolist()),
    }
    if extra:
        columns["notes"] = pa.array(["n"] * rows)  # a column the schema does not name
    return pa.table(columns)


def expected(frame: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    radius = (frame.column("radius").to_numpy() - 10.0) / 2.0
    age = frame.column("age").to_numpy().astype(np.float64)
    x = np.stack([radius, age], axis=1).astype(np.float32)
    y = np.array([["malignant", "benign"].index(v) for v in frame.column("diagnosis").to_pylist()])
    return x, y


@pytest.mark.parametrize("data_format", ["Parquet", "CSV"])
def test_a_table_is_read_checked_and_split_as_declared(tmp_path: Path, data_format: str) -> None:
    frames = {}
    for client in range(2):
        folder = tmp_path / f"site-{client}"
        folder.mkdir()
        frames[client] = table(50 + 7 * client, client)
        if data_format == "Parquet":
            pq.write_table(frames[client], folder / "part-0.parquet", row_group_size=16)
        else:
            pacsv.write_csv(frames[client], folder / "records.csv")
        (folder / "README.txt").write_text("not data")
    run = manifest(data_format, str(tmp_path / "site-{index}"), TABLE_SCHEMA, testFraction=0.25)
    for client, frame in frames.items():
        x, y = expected(frame)
        _, test_rows = shuffle_split(len(y), 0.25, 0)
        is_test = np.zeros(len(y), dtype=bool)
        is_test[test_rows] = True
        own = own_data(run.spec, client)
        np.testing.assert_array_equal(own.train.x, x[~is_test])
        np.testing.assert_array_equal(own.train.y, y[~is_test])
        np.testing.assert_array_equal(own.test.x, x[is_test])
        np.testing.assert_array_equal(own.test.y, y[is_test])
        assert own.train.num_classes == 2
        assert len(own.test) == math.ceil(0.25 * len(y))
        assert isinstance(own.train.x, np.memmap)  # mapped from the cache, not held
        assert not own.train.x.flags.writeable
        np.testing.assert_array_equal(client_dataset(run.spec, client).x, own.train.x)


def test_a_test_file_is_the_held_out_part_and_the_cache_is_reused(tmp_path: Path) -> None:
    folder = tmp_path / "site-0"
    folder.mkdir()
    train, test = table(40, 1), table(9, 2)
    pq.write_table(train, folder / "train.parquet")
    pq.write_table(test, folder / "test.parquet")
    (tmp_path / "site-1").mkdir()
    pq.write_table(table(5, 3), tmp_path / "site-1" / "train.parquet")
    run = manifest("Parquet", str(tmp_path / "site-{index}"), TABLE_SCHEMA)
    before = _cache.parse_count()
    own = own_data(run.spec, 0)
    np.testing.assert_array_equal(own.train.x, expected(train)[0])
    np.testing.assert_array_equal(client_test_dataset(run.spec, 0).y, expected(test)[1])
    assert _cache.parse_count() == before + 1
    _own._LOADED.clear()
    own_data(run.spec, 0)
    assert _cache.parse_count() == before + 1  # the second start maps the cached parse


def png(pixels: np.ndarray, mode: str = "L") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode=mode).save(buffer, format="PNG")
    return buffer.getvalue()


IMAGE_SCHEMA = {"labels": ["cat", "dog"], "image": {"height": 4, "width": 3, "channels": 1}}


def image_folder(root: Path, counts: dict[str, dict[str, int]], seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    made: dict[str, list[tuple[str, np.ndarray]]] = {}
    for part, per_label in counts.items():
        for label, count in per_label.items():
            folder = root / part / label if part else root / label
            folder.mkdir(parents=True, exist_ok=True)
            for number in range(count):
                pixels = rng.integers(0, 256, (4, 3), dtype=np.uint8)
                (folder / f"{number:03d}.png").write_bytes(png(pixels))
                made.setdefault(part or "train", []).append((f"{label}/{number:03d}", pixels))
    return made


def test_an_image_folder_is_read_scaled_and_normalized(tmp_path: Path) -> None:
    for client in range(2):
        image_folder(tmp_path / f"c{client}", {"train": {"cat": 3, "dog": 2}, "test": {"dog": 2}})
    schema = {**IMAGE_SCHEMA, "image": {**IMAGE_SCHEMA["image"], "mean": [0.5], "std": [0.25]}}
    run = manifest("ImageFolder", str(tmp_path / "c{index}"), schema)
    own = own_data(run.spec, 1)
    assert own.train.x.shape == (5, 1, 4, 3) and own.test.x.shape == (2, 1, 4, 3)
    np.testing.assert_array_equal(own.train.y, [0, 0, 0, 1, 1])
    np.testing.assert_array_equal(own.test.y, [1, 1])
    with Image.open(tmp_path / "c1" / "train" / "dog" / "001.png") as opened:
        pixels = np.asarray(opened, dtype=np.float32)
    np.testing.assert_allclose(own.train.x[4, 0], (pixels / 255.0 - 0.5) / 0.25, rtol=0, atol=0)


def test_images_without_a_split_are_split_by_test_fraction_and_resized(tmp_path: Path) -> None:
    for client in range(2):
        for label in ("cat", "dog"):
            folder = tmp_path / f"c{client}" / label
            folder.mkdir(parents=True)
            for number in range(5):
                (folder / f"{number}.png").write_bytes(
                    png(np.full((8, 6, 3), 40 * number, dtype=np.uint8), "RGB")
                )
    schema = {"labels": ["cat", "dog"], "image": {"height": 4, "width": 3, "resize": True}}
    run = manifest("ImageFolder", str(tmp_path / "c{index}"), schema, testFraction=0.3)
    own = own_data(run.spec, 0)
    assert len(own.train) + len(own.test) == 10 and len(own.test) == 3
    assert own.train.x.shape[1:] == (1, 4, 3)


def test_npz_files_are_read_against_the_declared_shape(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for client in range(2):
        folder = tmp_path / f"n{client}"
        folder.mkdir()
        x = rng.normal(size=(12, 1, 2, 2))
        np.savez(folder / "train.npz", x=x, y=rng.integers(0, 3, 12))
        np.savez(folder / "test.npz", x=x[:4], y=np.array([2, 1, 0, 2]))
    schema = {"labels": [0, 1, 2], "shape": [1, 2, 2]}
    own = own_data(manifest("Npz", str(tmp_path / "n{index}"), schema).spec, 1)
    np.testing.assert_array_equal(own.test.y, [2, 1, 0, 2])
    assert own.train.x.dtype == np.float32 and own.train.x.shape == (12, 1, 2, 2)


def test_a_hugging_face_folder_written_by_save_to_disk_is_read(tmp_path: Path) -> None:
    import datasets  # a dev dependency, to write real save_to_disk folders

    features = datasets.Features(
        {
            "radius": datasets.Value("float64"),
            "age": datasets.Value("int64"),
            "diagnosis": datasets.ClassLabel(names=["benign", "malignant"]),
        }
    )
    rng = np.random.default_rng(4)
    rows = {
        "radius": rng.normal(10, 2, 30).tolist(),
        "age": rng.integers(20, 90, 30).tolist(),
        "diagnosis": rng.integers(0, 2, 30).tolist(),
    }
    split = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict(
                {k: v[:24] for k, v in rows.items()}, features=features
            ),
            "test": datasets.Dataset.from_dict(
                {k: v[24:] for k, v in rows.items()}, features=features
            ),
        }
    )
    for client in range(2):
        split.save_to_disk(str(tmp_path / f"hf{client}"))
    run = manifest("HuggingFace", str(tmp_path / "hf{index}"), TABLE_SCHEMA)
    own = own_data(run.spec, 0)
    names = ["benign", "malignant"]  # ClassLabel's order, mapped to the schema's by name
    want = [["malignant", "benign"].index(names[v]) for v in rows["diagnosis"]]
    np.testing.assert_array_equal(own.train.y, want[:24])
    np.testing.assert_array_equal(own.test.y, want[24:])
    np.testing.assert_allclose(own.train.x[:, 0], (np.array(rows["radius"][:24]) - 10) / 2)


def test_a_hugging_face_image_data_set_is_read(tmp_path: Path) -> None:
    import datasets

    rng = np.random.default_rng(5)
    images = [Image.fromarray(rng.integers(0, 256, (4, 3), dtype=np.uint8)) for _ in range(6)]
    labels = [0, 1, 1, 0, 1, 0]
    frame = datasets.Dataset.from_dict(
        {"image": images, "label": labels},
        features=datasets.Features(
            {"image": datasets.Image(), "label": datasets.ClassLabel(names=["cat", "dog"])}
        ),
    )
    for client in range(2):
        frame.save_to_disk(str(tmp_path / f"hi{client}"))
    run = manifest("HuggingFace", str(tmp_path / "hi{index}"), IMAGE_SCHEMA, testFraction=0.5)
    own = own_data(run.spec, 1)
    assert len(own.train) == 3 and len(own.test) == 3
    every = np.concatenate([own.train.x, own.test.x])
    originals = np.stack([np.asarray(image, dtype=np.float32) / 255 for image in images])
    assert sorted(map(float, every.sum(axis=(1, 2, 3)))) == pytest.approx(
        sorted(map(float, originals.sum(axis=(1, 2)))), abs=1e-4
    )


# ------------------------------------------------------------------------------- refusals


def refused(run: FederatedRun, client: int = 0) -> str:
    with pytest.raises(DataError) as caught:
        own_data(run.spec, client)
    message = str(caught.value)
    assert f"Client {client}" in message
    assert str(SECRET) not in message and "7919" not in message  # no data value
    return message


def write_both(tmp_path: Path, frame: pa.Table, name: str = "records.parquet") -> str:
    for client in range(2):
        folder = tmp_path / f"s{client}"
        folder.mkdir(parents=True, exist_ok=True)
        if name.endswith(".csv"):
            pacsv.write_csv(frame, folder / name)
        else:
            pq.write_table(frame, folder / name)
    return str(tmp_path / "s{index}")


def test_a_missing_column_is_refused_by_name(tmp_path: Path) -> None:
    path = write_both(tmp_path, table(10, 0).drop(["age"]))
    assert "'age'" in refused(manifest("Parquet", path, TABLE_SCHEMA))
    assert "missing" in refused(manifest("Parquet", path, TABLE_SCHEMA))


@pytest.mark.parametrize("data_format", ["Parquet", "CSV"])
def test_a_column_of_the_wrong_type_is_refused_without_its_value(
    tmp_path: Path, data_format: str
) -> None:
    frame = table(10, 0).set_column(1, "age", pa.array([str(SECRET)] * 10))
    name = "records.csv" if data_format == "CSV" else "records.parquet"
    message = refused(manifest(data_format, write_both(tmp_path, frame, name), TABLE_SCHEMA))
    assert "'age'" in message and ("int64" in message or "type" in message)


@pytest.mark.parametrize("data_format", ["Parquet", "CSV"])
def test_an_unknown_label_is_refused_without_the_label(tmp_path: Path, data_format: str) -> None:
    frame = table(10, 0)
    labels = frame.column("diagnosis").to_pylist()
    labels[6] = "7919.25"
    frame = frame.set_column(2, "diagnosis", pa.array(labels))
    name = "records.csv" if data_format == "CSV" else "records.parquet"
    message = refused(manifest(data_format, write_both(tmp_path, frame, name), TABLE_SCHEMA))
    assert "row 6" in message and "spec.data.schema.labels" in message


def test_missing_values_and_non_finite_features_are_refused(tmp_path: Path) -> None:
    frame = table(10, 0)
    radius = frame.column("radius").to_pylist()
    radius[3] = None
    path = write_both(tmp_path, frame.set_column(0, "radius", pa.array(radius, pa.float64())))
    assert "missing values" in refused(manifest("Parquet", path, TABLE_SCHEMA))
    _own._LOADED.clear()
    radius[3] = float("nan")
    frame = frame.set_column(0, "radius", pa.array(radius, pa.float64()))
    path = write_both(tmp_path / "nan", frame)
    assert "not finite" in refused(manifest("Parquet", path, TABLE_SCHEMA))


def test_an_empty_shard_and_a_source_without_files_are_refused(tmp_path: Path) -> None:
    path = write_both(tmp_path, table(0, 0), "test.parquet")
    assert "no training examples" in refused(manifest("Parquet", path, TABLE_SCHEMA))
    (tmp_path / "e0").mkdir()
    (tmp_path / "e0" / "notes.txt").write_text("x")
    assert "holds no Parquet files" in refused(
        manifest("Parquet", str(tmp_path / "e{index}"), TABLE_SCHEMA)
    )
    assert "neither a folder nor a file" in refused(
        manifest("Parquet", str(tmp_path / "absent-{index}"), TABLE_SCHEMA)
    )


def test_an_image_of_the_wrong_size_a_corrupt_file_and_an_unknown_label_folder(
    tmp_path: Path,
) -> None:
    image_folder(tmp_path / "w0", {"": {"cat": 2, "dog": 1}})
    (tmp_path / "w0" / "dog" / "big.png").write_bytes(png(np.zeros((5, 3), np.uint8)))
    message = refused(manifest("ImageFolder", str(tmp_path / "w{index}"), IMAGE_SCHEMA))
    assert "big.png is 3x5 pixels" in message and "3x4" in message
    image_folder(tmp_path / "k0", {"": {"cat": 2}})
    (tmp_path / "k0" / "cat" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    assert "broken.png cannot be read as an image" in refused(
        manifest("ImageFolder", str(tmp_path / "k{index}"), IMAGE_SCHEMA)
    )
    image_folder(tmp_path / "u0", {"": {"cat": 2, "bird": 1}})
    message = refused(manifest("ImageFolder", str(tmp_path / "u{index}"), IMAGE_SCHEMA))
    assert "bird/ is a label folder" in message


def test_a_corrupt_table_file_is_refused(tmp_path: Path) -> None:
    for client in range(2):
        (tmp_path / f"b{client}").mkdir()
        (tmp_path / f"b{client}" / "x.parquet").write_bytes(b"PAR1" + b"\1" * 64)
    assert "cannot be read as Parquet" in refused(
        manifest("Parquet", str(tmp_path / "b{index}"), TABLE_SCHEMA)
    )


def test_npz_of_another_shape_is_refused(tmp_path: Path) -> None:
    for client in range(2):
        (tmp_path / f"z{client}").mkdir()
        np.savez(tmp_path / f"z{client}" / "a.npz", x=np.zeros((4, 3)), y=np.zeros(4, int))
    message = refused(manifest("Npz", str(tmp_path / "z{index}"), {"labels": [0, 1], "shape": [2]}))
    assert "shape (3,)" in message and "[2]" in message


# ------------------------------------------------------------------------------- the spec


def spec_issue(**changes: Any) -> str:
    body = document("Parquet", {"path": "d/{index}"}, TABLE_SCHEMA)
    for path, value in changes.items():
        node = body["spec"]
        *parents, last = path.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    with pytest.raises(SpecError) as caught:
        parse_manifest(body)
    return str(caught.value)


def test_the_manifest_refuses_what_client_data_cannot_run() -> None:
    assert "spec.data.schema.image" in spec_issue(data__schema=IMAGE_SCHEMA)
    assert "never mentions '{index}'" in spec_issue(
        data__clientData={"format": "Parquet", "template": {"path": "same"}}
    )
    assert "lists 1 sources" in spec_issue(
        data__clientData={"format": "Parquet", "sources": [{"path": "a"}]}
    )
    assert "spec.data.source" in spec_issue(data__source={"kind": "MNISTSubset"})
    assert "'Server' needs a held-out split" in spec_issue(evaluation={"where": "Server"})
    assert "never hold the true model" in spec_issue(protocol={"name": "perturb"})
    assert "spec.data.schema" in spec_issue(data__schema=None)
    assert "exactly one of path, volumeClaim and s3" in spec_issue(
        data__clientData={
            "format": "CSV",
            "template": {"path": "{index}", "s3": {"bucket": "b-{index}"}},
        }
    )
    assert "subPath" in spec_issue(
        data__clientData={
            "format": "CSV",
            "template": {"volumeClaim": {"claimName": "c-{index}", "subPath": "../x"}},
        }
    )
    assert "labels must each appear once" in spec_issue(
        data__schema={**TABLE_SCHEMA, "labels": ["a", "a"]}
    )


def test_a_volume_claim_is_refused_outside_a_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FEDCORE_DATA_DIR", raising=False)
    claim = {"volumeClaim": {"claimName": "site-{index}"}}
    run = parse_manifest(document("Parquet", claim, TABLE_SCHEMA))
    with pytest.raises(DataError, match=r"PersistentVolumeClaim 'site-1'.*only the operator"):
        own_data(run.spec, 1)
