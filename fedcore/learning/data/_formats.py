"""Readers of a client's own files, each checking them against the declared schema.

A reader streams: it hands the cache's sink one batch at a time (a table's record batch, a few
hundred images), so a client's data is never whole in memory while it is parsed. Every file is
checked against ``spec.data.schema`` as it is read; a problem raises a ``DataError`` that names
the file, the column or folder, and what is wrong, and never a value of the data (a label, a
cell, a pixel): messages go to logs and to the server.

Each reader sorts a location's files into parts: ``train`` and, where the source holds one,
``test`` (the client's held-out split).
"""

from __future__ import annotations

import contextlib
import json
import re
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedcore.errors import DataError
from fedcore.learning.data._locations import Location, SourceFile
from fedcore.spec._data import DataSchemaSpec, FeatureSpec, ImageSchemaSpec

TRAIN = "train"
TEST = "test"

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg"})
IMAGE_BATCH = 256
"""Images handed to the sink at a time."""
TABLE_BATCH = 65_536
"""Rows of a table read at a time."""

Emit = Callable[[str, np.ndarray, np.ndarray], None]
"""Where a reader hands a batch: ``emit(part, x, y)``."""


@dataclass(frozen=True)
class PartFile:
    """A file of the source and the part it belongs to (for an image, also its label)."""

    file: SourceFile
    part: str
    label: str | None = None


class Reader:
    """Reads one format. Subclasses sort the files into parts, count rows, and read."""

    def __init__(self, schema: DataSchemaSpec, location: Location) -> None:
        self.schema = schema
        self.location = location

    def parts(self, files: Sequence[SourceFile]) -> list[PartFile]:
        """The files this format reads, each with its part; other files are ignored."""
        raise NotImplementedError

    def count(self, item: PartFile, path: Path) -> int:
        """The number of examples in one file."""
        raise NotImplementedError

    def read(self, item: PartFile, path: Path, emit: Emit) -> None:
        """Reads one file, checking it, and emits its examples in batches to ``item.part``."""
        raise NotImplementedError

    def prepare(self, files: Sequence[SourceFile]) -> None:
        """Reads what the format keeps beside its data (HuggingFace's dataset_info.json)."""

    def read_all(self, items: Sequence[PartFile], emit: Emit) -> None:
        """Reads every file in turn, each fetched from the location while it is read."""
        for item in items:
            with self.location.local(item.file) as path:
                self.read(item, path, emit)

    def name(self, item: PartFile) -> str:
        """The file as messages name it."""
        return f"{self.location.where.rstrip('/')}/{item.file.name}"


def _split_part(name: str) -> str:
    """``test`` for a file under a ``test/`` folder or whose name starts with ``test``."""
    first = name.split("/", 1)[0]
    stem = Path(name).name.split(".", 1)[0]
    return TEST if first == TEST or stem == TEST or stem.startswith("test-") else TRAIN


# ------------------------------------------------------------------------------------- tables


class _Labels:
    """Maps a label column's values to classes (positions in ``schema.labels``)."""

    def __init__(self, schema: DataSchemaSpec) -> None:
        import pyarrow as pa

        self.labels = schema.labels
        self.strings = isinstance(schema.labels[0], str)
        self.value_set = pa.array(
            [str(label) for label in schema.labels]
            if self.strings
            else [int(label) for label in schema.labels],
            type=pa.string() if self.strings else pa.int64(),
        )

    def classes(self, column: Any, where: str, column_name: str) -> np.ndarray:
        """The classes of a label column (an Arrow array), checked: no missing value, no label
        outside the set, and the column's type fits the set's."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        if pa.types.is_dictionary(column.type):
            column = column.dictionary_decode()
        kind = column.type
        if self.strings and not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise DataError(
                f"{where}: the label column {column_name!r} holds {kind}, but "
                f"spec.data.schema.labels are strings."
            )
        if not self.strings and not pa.types.is_integer(kind):
            raise DataError(
                f"{where}: the label column {column_name!r} holds {kind}, but "
                f"spec.data.schema.labels are whole numbers."
            )
        if column.null_count:
            raise DataError(f"{where}: the label column {column_name!r} has missing values.")
        column = column.cast(pa.string()) if self.strings else column.cast(pa.int64())
        positions = pc.index_in(column, value_set=self.value_set)
        if positions.null_count:
            row = int(np.flatnonzero(positions.is_null().to_numpy(zero_copy_only=False))[0])
            raise DataError(
                f"{where}: row {row} of the label column {column_name!r} holds a label that "
                f"is not in spec.data.schema.labels."
            )
        return positions.to_numpy(zero_copy_only=False).astype(np.int64)


def _check_feature_type(kind: Any, feature: FeatureSpec, where: str) -> None:
    """Refuses a column whose Arrow type does not fit the declared one."""
    import pyarrow as pa

    if feature.type in ("float32", "float64"):
        fits = pa.types.is_floating(kind) or pa.types.is_integer(kind)
    elif feature.type in ("int32", "int64"):
        fits = pa.types.is_integer(kind)
    else:
        fits = pa.types.is_boolean(kind)
    if not fits:
        raise DataError(
            f"{where}: the column {feature.name!r} holds {kind}, but spec.data.schema.features "
            f"declares it {feature.type}."
        )


def _table_batch(
    batch: Any, schema: DataSchemaSpec, labels: _Labels, where: str, label_column: Any = None
) -> tuple[np.ndarray, np.ndarray]:
    """Features (float32, one column per feature) and classes of one Arrow record batch
    (``label_column``: the labels, when not the batch's own column)."""
    assert schema.features is not None
    names = batch.schema.names
    columns = []
    for feature in schema.features:
        column = batch.column(names.index(feature.name))
        _check_feature_type(column.type, feature, where)
        if column.null_count:
            raise DataError(f"{where}: the column {feature.name!r} has missing values.")
        values = column.to_numpy(zero_copy_only=False).astype(np.float64)
        values = ((values - feature.center) / feature.scale).astype(np.float32)
        if not np.isfinite(values).all():
            raise DataError(
                f"{where}: the column {feature.name!r} has values that are not finite (NaN or "
                f"infinite) as float32."
            )
        columns.append(values)
    x = np.stack(columns, axis=1) if columns else np.empty((batch.num_rows, 0), np.float32)
    if label_column is None:
        label_column = batch.column(names.index(schema.label_column))
    return x, labels.classes(label_column, where, schema.label_column)


def _check_columns(names: Sequence[str], schema: DataSchemaSpec, where: str) -> None:
    """Refuses a table that lacks a declared column."""
    assert schema.features is not None
    wanted = [schema.label_column, *(feature.name for feature in schema.features)]
    missing = [name for name in wanted if name not in names]
    if missing:
        listed = ", ".join(repr(name) for name in missing)
        raise DataError(
            f"{where}: the column{'s' if len(missing) > 1 else ''} {listed} of "
            f"spec.data.schema {'are' if len(missing) > 1 else 'is'} missing."
        )


class ParquetReader(Reader):
    """Parquet files (``.parquet``, ``.pq``), read a record batch at a time."""

    def parts(self, files: Sequence[SourceFile]) -> list[PartFile]:
        return [
            PartFile(file, _split_part(file.name))
            for file in files
            if Path(file.name).suffix in (".parquet", ".pq")
        ]

    def _open(self, item: PartFile, path: Path) -> Any:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{self.name(item)} cannot be read as Parquet: {exc}") from exc

    def count(self, item: PartFile, path: Path) -> int:
        return int(self._open(item, path).metadata.num_rows)

    def read(self, item: PartFile, path: Path, emit: Emit) -> None:
        import pyarrow as pa

        where = self.name(item)
        table = self._open(item, path)
        _check_columns(table.schema_arrow.names, self.schema, where)
        assert self.schema.features is not None
        columns = [self.schema.label_column, *(f.name for f in self.schema.features)]
        labels = _Labels(self.schema)
        try:
            for batch in table.iter_batches(batch_size=TABLE_BATCH, columns=columns):
                emit(item.part, *_table_batch(batch, self.schema, labels, where))
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{where} cannot be read as Parquet: {exc}") from exc


class CsvReader(Reader):
    """CSV files (``.csv``, ``.csv.gz``) with a header row, read a block at a time.

    Every declared column is read with its declared type (the label column as a string or a
    whole number, as ``schema.labels`` are): a cell that is not of that type refuses the file,
    naming the column, never the cell.
    """

    def parts(self, files: Sequence[SourceFile]) -> list[PartFile]:
        return [
            PartFile(file, _split_part(file.name))
            for file in files
            if file.name.endswith((".csv", ".csv.gz"))
        ]

    def _header(self, item: PartFile, path: Path) -> list[str]:
        """The header's column names, after checking that the schema's columns are there."""
        import pyarrow as pa
        import pyarrow.csv as csv

        try:
            reader = csv.open_csv(path, read_options=csv.ReadOptions(block_size=1 << 20))
        except (pa.ArrowException, OSError) as exc:
            raise DataError(_csv_problem(self.name(item), exc)) from exc
        header = list(reader.schema.names)
        _check_columns(header, self.schema, self.name(item))
        return header

    def _batches(self, item: PartFile, path: Path, types: dict[str, Any]) -> Iterator[Any]:
        """The file's record batches, holding only the columns of ``types``, each parsed as
        its type (a cell that is not refuses the file, naming its column)."""
        import pyarrow as pa
        import pyarrow.csv as csv

        header = self._header(item, path)
        convert = csv.ConvertOptions(column_types=types, include_columns=list(types))
        try:
            reader = csv.open_csv(
                path, read_options=csv.ReadOptions(block_size=8 << 20), convert_options=convert
            )
            yield from reader
        except (pa.ArrowException, OSError) as exc:
            raise DataError(_csv_problem(self.name(item), exc, header)) from exc

    def count(self, item: PartFile, path: Path) -> int:
        """The rows, from the label column alone (read as strings: types are checked when
        the file is read)."""
        import pyarrow as pa

        label = {self.schema.label_column: pa.string()}
        return sum(batch.num_rows for batch in self._batches(item, path, label))

    def read(self, item: PartFile, path: Path, emit: Emit) -> None:
        import pyarrow as pa

        schema = self.schema
        assert schema.features is not None
        label = pa.string() if isinstance(schema.labels[0], str) else pa.int64()
        types = {schema.label_column: label}
        types.update({f.name: _arrow_type(f.type) for f in schema.features})
        labels = _Labels(schema)
        for batch in self._batches(item, path, types):
            emit(item.part, *_table_batch(batch, schema, labels, self.name(item)))


def _arrow_type(name: str) -> Any:
    """The Arrow type of a declared feature type (``bool`` is Arrow's ``bool_``)."""
    import pyarrow as pa

    return getattr(pa, "bool_" if name == "bool" else name)()


def _csv_problem(where: str, exc: Exception, header: Sequence[str] = ()) -> str:
    """Arrow's CSV error, without the cell it quotes (the column named from the header)."""
    text = str(exc)
    if "conversion error" in text.lower() or "invalid value" in text.lower():
        number = re.search(r"column #(\d+)", text)
        column = None
        if number is not None and int(number.group(1)) < len(header):
            column = header[int(number.group(1))]
        named = f"the column {column!r}" if column else "a column"
        return (
            f"{where}: {named} holds a value that is not of its declared type (spec.data.schema)."
        )
    if "Expected" in text and "columns" in text:
        return f"{where}: a row has a different number of columns than the header."
    return f"{where} cannot be read as CSV ({type(exc).__name__})."


# ------------------------------------------------------------------------------------- images


class ImageFolderReader(Reader):
    """One sub-folder per label holding PNG or JPEG files; ``train/`` and ``test/`` folders
    above them, if present, are the parts."""

    def parts(self, files: Sequence[SourceFile]) -> list[PartFile]:
        items = []
        split = any(file.name.split("/", 1)[0] in (TRAIN, TEST) for file in files)
        for file in files:
            pieces = file.name.split("/")
            if Path(file.name).suffix.lower() not in IMAGE_SUFFIXES:
                continue
            if split:
                if pieces[0] not in (TRAIN, TEST) or len(pieces) != 3:
                    continue
                items.append(PartFile(file, pieces[0], pieces[1]))
            elif len(pieces) == 2:
                items.append(PartFile(file, TRAIN, pieces[0]))
        return items

    def count(self, item: PartFile, path: Path) -> int:
        return 1

    def read_all(self, items: Sequence[PartFile], emit: Emit) -> None:
        """Reads the images :data:`IMAGE_BATCH` files at a time, each batch of one part."""
        by_part: dict[str, list[PartFile]] = {}
        for item in items:
            by_part.setdefault(item.part, []).append(item)
        for part_items in by_part.values():
            for start in range(0, len(part_items), IMAGE_BATCH):
                batch = part_items[start : start + IMAGE_BATCH]
                with contextlib.ExitStack() as fetched:
                    paths = [fetched.enter_context(self.location.local(i.file)) for i in batch]
                    self._read_batch(list(zip(batch, paths, strict=True)), emit)

    def _read_batch(self, items: Sequence[tuple[PartFile, Path]], emit: Emit) -> None:
        """Decodes and checks images of one part; emits them together."""
        image = self.schema.image
        assert image is not None
        classes = {str(label): position for position, label in enumerate(self.schema.labels)}
        xs = []
        ys = []
        for item, path in items:
            folder = item.file.name.rsplit("/", 1)[0]
            if item.label not in classes:
                raise DataError(
                    f"{self.location.where.rstrip('/')}/{folder}/ is a label folder whose name "
                    f"is not in spec.data.schema.labels."
                )
            xs.append(decode_image(path.read_bytes(), image, self.name(item)))
            ys.append(classes[item.label])
        if xs:
            emit(items[0][0].part, np.stack(xs), np.asarray(ys, dtype=np.int64))


def decode_image(data: bytes, image: ImageSchemaSpec, where: str) -> np.ndarray:
    """One image as float32 (channels, height, width): scaled to [0, 1], then the schema's
    mean and std applied.

    Raises:
        DataError: the bytes are not a PNG or JPEG image Pillow can read, or the image has
            another size and the schema does not resize.
    """
    import io
    import warnings

    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as opened:
                if opened.format not in ("PNG", "JPEG"):
                    raise DataError(f"{where} is a {opened.format} image; PNG or JPEG needed.")
                size = opened.size
                if size != (image.width, image.height) and not image.resize:
                    raise DataError(
                        f"{where} is {size[0]}x{size[1]} pixels; spec.data.schema.image is "
                        f"{image.width}x{image.height} (set resize: true to scale images)."
                    )
                converted = opened.convert("L" if image.channels == 1 else "RGB")
                if converted.size != (image.width, image.height):
                    converted = converted.resize(
                        (image.width, image.height), Image.Resampling.BILINEAR
                    )
                pixels = np.asarray(converted, dtype=np.float32) / 255.0
    except DataError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise DataError(f"{where} cannot be read as an image ({type(exc).__name__}).") from exc
    except Image.DecompressionBombWarning as exc:
        raise DataError(f"{where} has too many pixels to decode safely.") from exc
    pixels = pixels[None, :, :] if pixels.ndim == 2 else np.transpose(pixels, (2, 0, 1))
    if image.mean is not None:
        pixels = pixels - np.asarray(image.mean, dtype=np.float32)[:, None, None]
    if image.std is not None:
        pixels = pixels / np.asarray(image.std, dtype=np.float32)[:, None, None]
    return np.ascontiguousarray(pixels, dtype=np.float32)


# ---------------------------------------------------------------------------------------- npz


class NpzReader(Reader):
    """``.npz`` files with arrays ``x`` (examples first) and ``y`` (whole labels);
    ``test.npz`` is the held-out part."""

    def parts(self, files: Sequence[SourceFile]) -> list[PartFile]:
        return [
            PartFile(file, _split_part(file.name))
            for file in files
            if Path(file.name).suffix == ".npz"
        ]

    def _arrays(self, item: PartFile, path: Path) -> tuple[np.ndarray, np.ndarray]:
        where = self.name(item)
        try:
            with np.load(path, allow_pickle=False) as archive:
                names = list(archive.files)
                if "x" not in names or "y" not in names:
                    raise DataError(f"{where} needs arrays x and y.")
                x, y = archive["x"], archive["y"]
        except DataError:
            raise
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
            raise DataError(f"{where} cannot be read as .npz ({type(exc).__name__}).") from exc
        return x, y

    def count(self, item: PartFile, path: Path) -> int:
        return len(self._arrays(item, path)[1])

    def read(self, item: PartFile, path: Path, emit: Emit) -> None:
        where = self.name(item)
        x, y = self._arrays(item, path)
        shape = tuple(self.schema.shape or ())
        if x.ndim < 1 or tuple(x.shape[1:]) != shape:
            raise DataError(
                f"{where}: x holds examples of shape {tuple(x.shape[1:])}; spec.data.schema."
                f"shape is {list(shape)}."
            )
        if y.ndim != 1 or len(y) != len(x):
            raise DataError(f"{where}: y must hold one label per row of x.")
        if x.dtype.kind not in "biuf":
            raise DataError(f"{where}: x holds {x.dtype}; it must be numeric.")
        features = x.astype(np.float32)
        if not np.isfinite(features).all():
            raise DataError(f"{where}: x has values that are not finite (NaN or infinite).")
        emit(item.part, features, _classes_of(y, self.schema, where))


def _classes_of(y: np.ndarray, schema: DataSchemaSpec, where: str) -> np.ndarray:
    """The classes of whole-number or string labels, checked against the label set."""
    import pyarrow as pa

    labels = _Labels(schema)
    if y.dtype.kind in "US":
        column = pa.array(y.astype(str))
    elif y.dtype.kind in "iu" or (
        y.dtype.kind == "f" and np.isfinite(y).all() and np.array_equal(y, np.round(y))
    ):
        column = pa.array(y.astype(np.int64))
    else:
        raise DataError(f"{where}: y holds {y.dtype} values that are not labels.")
    return labels.classes(column, where, "y")


# -------------------------------------------------------------------------------- HuggingFace


class HuggingFaceReader(Reader):
    """A folder written by ``datasets``' ``save_to_disk``: a Dataset (``state.json`` and
    Arrow stream files), or a DatasetDict (``dataset_dict.json``, one such folder per split;
    split ``test`` is held out, split ``train`` trained on, others ignored). Read with pyarrow
    alone: the ``datasets`` package is not needed to read one.
    """

    def __init__(self, schema: DataSchemaSpec, location: Location) -> None:
        super().__init__(schema, location)
        self._names: list[str] | None = None
        """The label column's ClassLabel names, from ``dataset_info.json`` (``prepare``)."""

    def parts(self, files: Sequence[SourceFile]) -> list[PartFile]:
        names = {file.name for file in files}
        items = []
        if "dataset_dict.json" in names:
            for file in files:
                pieces = file.name.split("/")
                if len(pieces) == 2 and pieces[0] in (TRAIN, TEST) and pieces[1].endswith(".arrow"):
                    items.append(PartFile(file, pieces[0]))
        elif "state.json" in names:
            items = [
                PartFile(file, TRAIN)
                for file in files
                if "/" not in file.name and file.name.endswith(".arrow")
            ]
        return items

    def _stream(self, item: PartFile, path: Path) -> Any:
        import pyarrow as pa

        try:
            return pa.ipc.open_stream(pa.memory_map(str(path), "r"))
        except (pa.ArrowException, OSError) as exc:
            try:
                return pa.ipc.open_file(pa.memory_map(str(path), "r"))
            except (pa.ArrowException, OSError):
                raise DataError(
                    f"{self.name(item)} cannot be read as an Arrow file ({type(exc).__name__})."
                ) from exc

    def _batches(self, item: PartFile, path: Path) -> Iterator[Any]:
        import pyarrow as pa

        reader = self._stream(item, path)
        try:
            if isinstance(reader, pa.ipc.RecordBatchFileReader):
                for number in range(reader.num_record_batches):
                    yield reader.get_batch(number)
            else:
                yield from reader
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{self.name(item)} cannot be read ({type(exc).__name__}).") from exc

    def count(self, item: PartFile, path: Path) -> int:
        return sum(batch.num_rows for batch in self._batches(item, path))

    def read(self, item: PartFile, path: Path, emit: Emit) -> None:
        where = self.name(item)
        schema = self.schema
        labels = _Labels(schema)
        for batch in self._batches(item, path):
            names = batch.schema.names
            if schema.label_column not in names:
                raise DataError(f"{where}: the column {schema.label_column!r} is missing.")
            label_column = batch.column(names.index(schema.label_column))
            label_column = self._named(label_column)
            if schema.image is not None:
                if schema.image.column not in names:
                    raise DataError(f"{where}: the column {schema.image.column!r} is missing.")
                images = batch.column(names.index(schema.image.column))
                x = (
                    np.stack(
                        [
                            decode_image(_image_bytes(value, where), schema.image, where)
                            for value in images.to_pylist()
                        ]
                    )
                    if batch.num_rows
                    else np.empty((0, *schema.input_shape), np.float32)
                )
                y = labels.classes(label_column, where, schema.label_column)
            else:
                _check_columns(names, schema, where)
                x, y = _table_batch(batch, schema, labels, where, label_column)
            emit(item.part, x, y)

    def _named(self, column: Any) -> Any:
        """A ClassLabel column (integers) as its names, when the schema's labels are
        strings and the data set's info names the classes."""
        import pyarrow as pa

        if not isinstance(self.schema.labels[0], str) or not pa.types.is_integer(column.type):
            return column
        names = self._names
        if names is None:
            return column
        indices = column.to_numpy(zero_copy_only=False)
        if len(indices) and (indices.min() < 0 or indices.max() >= len(names)):
            return pa.array([None] * len(indices), type=pa.string())
        return pa.array([names[int(i)] for i in indices], type=pa.string())

    def prepare(self, files: Sequence[SourceFile]) -> None:
        """Reads the data set's ``dataset_info.json`` files (small): the label column's
        ClassLabel names, if it has them."""
        for file in files:
            if Path(file.name).name != "dataset_info.json":
                continue
            with self.location.local(file) as path:
                try:
                    info = json.loads(path.read_text(encoding="utf-8"))
                except (OSError, ValueError) as exc:
                    raise DataError(
                        f"{self.location.where.rstrip('/')}/{file.name} cannot be read as "
                        f"JSON ({type(exc).__name__})."
                    ) from exc
            feature = (info.get("features") or {}).get(self.schema.label_column) or {}
            if feature.get("_type") == "ClassLabel" and feature.get("names"):
                self._names = [str(name) for name in feature["names"]]
                return


def _image_bytes(value: Any, where: str) -> bytes:
    """The encoded bytes of a ``datasets`` Image value (``{"bytes": ..., "path": ...}``)."""
    if isinstance(value, dict) and isinstance(value.get("bytes"), bytes):
        return value["bytes"]
    if isinstance(value, bytes):
        return value
    raise DataError(f"{where}: an image value holds no embedded bytes (save it with its bytes).")


READERS: dict[str, type[Reader]] = {
    "Parquet": ParquetReader,
    "CSV": CsvReader,
    "ImageFolder": ImageFolderReader,
    "Npz": NpzReader,
    "HuggingFace": HuggingFaceReader,
}
"""The reader of each ``spec.data.clientData.format``."""
