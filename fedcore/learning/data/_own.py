"""A client's own data (``spec.data.clientData``): read where it is, checked against the
schema, split into the client's training and held-out examples, cached on the client's machine.

The parse runs once per machine and source version (``_cache``): later starts map the cached
arrays read-only. Without a held-out part in the source, the client holds out
``spec.data.testFraction`` of its own rows, drawn as ``shuffle_split`` draws the shared
source's (seeded by ``spec.data.splitSeed``): a first pass counts the rows, the second routes
each row to its part, so that neither pass holds the data in memory.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedcore.errors import DataError
from fedcore.learning.data._cache import Sink, cache_root, open_source
from fedcore.learning.data._formats import READERS, TEST, TRAIN, Reader
from fedcore.learning.data._locations import Location, SourceFile, open_location
from fedcore.learning.data._sources import ArrayDataset, shuffle_split
from fedcore.spec import FederatedRunSpec
from fedcore.spec._data import ClientDataSpec, DataSchemaSpec


@dataclass(frozen=True)
class OwnData:
    """A client's own examples: what it trains on and what it holds out.

    Both are read-only; their features are memory maps of the cache when there is one.
    """

    train: ArrayDataset
    test: ArrayDataset


def own_data(spec: FederatedRunSpec, index: int) -> OwnData:
    """Reads client ``index``'s own source (through this machine's cache) and splits it.

    Raises:
        DataError: naming the client, the file and what is wrong with it (a missing column, a
            wrong type, a label outside the schema's, an image of the wrong size, a corrupt
            file) or that the client holds no training example; never a data value.
    """
    own = spec.data.client_data
    schema = spec.data.schema_
    if own is None or schema is None:
        raise DataError("spec.data.clientData and spec.data.schema are needed for own data.")
    key = (
        own.model_dump_json(),
        schema.model_dump_json(),
        spec.data.test_fraction,
        spec.data.split_seed,
        index,
    )
    found = _LOADED.get(key)
    if found is None:
        found = _own_data(own, schema, spec.data.test_fraction, spec.data.split_seed, index)
        if len(_LOADED) >= 8:
            _LOADED.pop(next(iter(_LOADED)))
        _LOADED[key] = found
    return found


_LOADED: dict[tuple[str, str, float, int, int], OwnData] = {}
"""The data sets this process has loaded, by source (a few; their arrays are maps)."""


def _own_data(
    own: ClientDataSpec, schema: DataSchemaSpec, test_fraction: float, seed: int, index: int
) -> OwnData:
    source = own.source_of(index)
    root = cache_root()
    location = open_location(source, index, _scratch(root))
    try:
        files = location.files()
        listing: list[Any] = [[file.name, file.size, file.version] for file in files]
        key = {
            "kind": "ClientData",
            "format": own.format,
            **location.key(),
            "files": listing,
            "schema": schema.model_dump(mode="json", by_alias=True),
            "test_fraction": test_fraction,
            "split_seed": seed,
        }
        reader = READERS[own.format](schema, location)
        parse = functools.partial(
            _parse, reader, location, files, own.format, test_fraction, seed, index
        )
        stored = open_source(f"client-{index}", key, parse)
    except DataError as exc:
        raise DataError(f"Client {index}'s data: {exc}") from exc
    train_rows = stored.rows.get(TRAIN, 0)
    if train_rows == 0:
        raise DataError(
            f"Client {index}'s data at {location.where} holds no training examples (an empty "
            f"shard)."
        )
    classes = len(schema.labels)

    def part(name: str) -> ArrayDataset:
        if not stored.has(name):
            empty = np.empty((0, *schema.input_shape), dtype=np.float32)
            return ArrayDataset(empty, np.empty(0, dtype=np.int64), classes)
        return ArrayDataset(stored.features(name), stored.labels(name), classes)

    return OwnData(part(TRAIN), part(TEST))


def _scratch(root: Path | None) -> Path | None:
    """Where downloaded objects wait to be read: beside the cache (its file system)."""
    if root is None:
        return None
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return root if os.access(root, os.W_OK) else None


def _parse(
    reader: Reader,
    location: Location,
    files: list[SourceFile],
    data_format: str,
    test_fraction: float,
    seed: int,
    index: int,
    sink: Sink,
) -> tuple[int, str]:
    """Reads every file of the client's source into the sink's train and test parts."""
    schema = reader.schema
    reader.prepare(files)
    items = reader.parts(files)
    if not items:
        raise DataError(f"{location.where} holds no {data_format} files.")
    emit = sink
    if not any(item.part == TEST for item in items):
        total = 0
        for item in items:
            with location.local(item.file) as path:
                total += reader.count(item, path)
        emit = _Router(sink, total, test_fraction, seed)
    reader.read_all(items, emit)
    empty = np.empty((0, *schema.input_shape), dtype=np.float32)
    sink(TRAIN, empty, np.empty(0, dtype=np.int64))  # the part exists even when empty
    return len(schema.labels), location.where


class _Router:
    """Sends each row to train or test by its position in the source: the test rows are
    those ``shuffle_split(total, test_fraction, seed)`` holds out."""

    def __init__(self, sink: Sink, total: int, test_fraction: float, seed: int) -> None:
        if total < 2:
            raise DataError(
                f"holds {total} example(s); at least 2 are needed to hold out "
                f"spec.data.testFraction of them (or provide a test part)."
            )
        _, test_rows = shuffle_split(total, test_fraction, seed)
        self.is_test = np.zeros(total, dtype=bool)
        self.is_test[test_rows] = True
        self.sink = sink
        self.offset = 0

    def __call__(self, part: str, x: np.ndarray, y: np.ndarray) -> None:
        count = len(y)
        mask = self.is_test[self.offset : self.offset + count]
        if len(mask) != count:
            raise DataError("changed while it was read (it has more rows than were counted).")
        self.offset += count
        self.sink(TRAIN, x[~mask], y[~mask])
        if mask.any():
            self.sink(TEST, x[mask], y[mask])
