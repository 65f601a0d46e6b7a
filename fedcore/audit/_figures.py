"""The report's figures (PNG, matplotlib's Agg canvas; no global pyplot state)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fedcore.audit._metrics import Estimate

MAX_COLUMNS = 8
"""Examples shown per reconstruction figure."""


def _save(figure: Figure, path: Path) -> None:
    """Writes ``figure`` as a PNG."""
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(figure)
    figure.savefig(path, format="png", dpi=80)


def _image(vector: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """An example as a 2-D image (channels averaged; a vector as one row)."""
    if len(shape) >= 2 and shape[-1] > 1 and shape[-2] > 1:
        return vector.reshape(-1, shape[-2], shape[-1]).mean(axis=0)
    return vector.reshape(1, -1)


def reconstructions(
    path: Path,
    pairs: Sequence[tuple[np.ndarray, np.ndarray]],
    shape: tuple[int, ...],
    title: str,
    *,
    low: float,
    high: float,
) -> None:
    """Targets (top row) above their reconstructions (bottom row)."""
    shown = list(pairs)[:MAX_COLUMNS]
    columns = max(len(shown), 1)
    figure = Figure(figsize=(1.2 * columns + 0.6, 3.0))
    axes = figure.subplots(2, columns, squeeze=False)
    for column in range(columns):
        for row in range(2):
            axis = axes[row][column]
            axis.set_xticks([])
            axis.set_yticks([])
            if column < len(shown):
                axis.imshow(_image(shown[column][row], shape), cmap="gray_r", vmin=low, vmax=high)
    axes[0][0].set_ylabel("true")
    axes[1][0].set_ylabel("attack")
    figure.suptitle(title, fontsize=9)
    _save(figure, path)


def roc(path: Path, curves: dict[str, tuple[np.ndarray, np.ndarray, float]], title: str) -> None:
    """ROC curves, one per label, with the chance diagonal."""
    figure = Figure(figsize=(4.2, 4.0))
    axis = figure.subplots()
    axis.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="chance")
    for label, (fpr, tpr, auc) in curves.items():
        axis.plot(fpr, tpr, linewidth=1.5, label=f"{label} (AUC {auc:.3f})")
    axis.set_xlabel("false positive rate")
    axis.set_ylabel("true positive rate")
    axis.set_title(title, fontsize=9)
    axis.legend(fontsize=7, loc="lower right")
    _save(figure, path)


def bars(path: Path, estimates: Sequence[Estimate], title: str) -> None:
    """One bar per estimate with its 95% interval, and each estimate's chance level."""
    figure = Figure(figsize=(1.3 * len(estimates) + 2.0, 3.4))
    axis = figure.subplots()
    positions = np.arange(len(estimates))
    values = [e.value for e in estimates]
    errors = np.array([[e.value - e.low for e in estimates], [e.high - e.value for e in estimates]])
    errors = np.maximum(errors, 0.0)  # a bootstrap end can pass the mean by a rounding error
    axis.bar(positions, values, yerr=errors, capsize=4, color="#4878a8")
    for position, estimate in zip(positions, estimates, strict=True):
        if estimate.chance is not None:
            axis.hlines(
                estimate.chance, position - 0.4, position + 0.4, colors="#c03030", linewidth=2
            )
    axis.set_xticks(positions, [e.name for e in estimates], fontsize=7)
    axis.set_ylim(0, 1.05 * max(1.0, *(e.high for e in estimates)))
    axis.set_title(f"{title} (red: chance)", fontsize=9)
    _save(figure, path)
