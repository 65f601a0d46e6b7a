"""Marks a folder's tests: each tier's conftest.py marks what it collects."""

from __future__ import annotations

from pathlib import Path

import pytest


def mark_folder(items: list[pytest.Item], folder: Path, mark: pytest.MarkDecorator) -> None:
    """Adds ``mark`` to every collected test under ``folder``."""
    for item in items:
        if folder in Path(str(item.fspath)).parents:
            item.add_marker(mark)
