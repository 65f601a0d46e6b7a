"""Tensors that lie back to back in one buffer, worked on as one array.

A model is many tensors, and an upload's checks and the server's fold went through them one at
a time: on a small model (the digits MLP is four tensors, 36 KB in all) the calls, not the bytes,
cost most of an upload's check and fold, and a deep network has hundreds of tensors. Yet a
decoded message's tensors view one body, back to back in the header's order, and a fold's sums
and the mean it makes are one buffer each (``PackedTensors``). So elementwise work runs once per
stretch of positions over which every operand is one run, on a 1-D view of each: the same
operations per element, so the same bits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import accumulate, pairwise

import numpy as np

from fedcore.transport._payload import PackedTensors, Run


def runs_of(tensors: Mapping[str, np.ndarray]) -> list[Run]:
    """``tensors``' runs: a ``PackedTensors``' own, else one per tensor (its 1-D view, a copy
    only where a tensor is not C-contiguous)."""
    if isinstance(tensors, PackedTensors):
        found = tensors.runs()
        if found is not None:
            return found
    return [
        (index, index + 1, np.ascontiguousarray(value).reshape(-1))
        for index, value in enumerate(tensors.values())
    ]


def stretches(sizes: Sequence[int], *operands: list[Run]) -> list[tuple[np.ndarray, ...]]:
    """For operands whose tensors have ``sizes`` elements position by position (an upload, the
    sums, the model): the stretches of positions over which every operand is one run, each as
    one 1-D view per operand, in order. Over the stretches the views hold every element once,
    in the tensors' order.

    Raises:
        ValueError: an operand's runs do not cover the positions of ``sizes`` in order, or a
            run's view does not hold its tensors' elements.
    """
    count = len(sizes)
    offsets = list(accumulate(sizes, initial=0))
    for runs in operands:
        expected = 0
        for start, stop, view in runs:
            if start != expected or stop <= start or view.size != offsets[stop] - offsets[start]:
                raise ValueError("An operand's runs do not match the tensors' sizes.")
            expected = stop
        if expected != count:
            raise ValueError("An operand's runs do not cover every tensor.")
    if not count:
        return []
    split = [runs for runs in operands if len(runs) > 1]
    if not split:  # every operand one buffer
        return [tuple(runs[0][2] for runs in operands)]
    cuts = split[0]
    if all(_same_bounds(runs, cuts) for runs in split[1:]):
        # The usual case: the operands that are cut are cut alike (an upload against the
        # model), the others are one buffer each (the sums), sliced the same way.
        columns = [
            [view for _, _, view in runs]
            if len(runs) > 1
            else [runs[0][2][offsets[start] : offsets[stop]] for start, stop, _ in cuts]
            for runs in operands
        ]
        return list(zip(*columns, strict=True))
    bounds = sorted({start for runs in operands for start, _, _ in runs} | {count})
    found: list[tuple[np.ndarray, ...]] = []
    cursors = [0] * len(operands)
    for start, stop in pairwise(bounds):
        views = []
        for which, runs in enumerate(operands):
            while runs[cursors[which]][1] <= start:
                cursors[which] += 1
            run_start, _, view = runs[cursors[which]]
            low = offsets[start] - offsets[run_start]
            views.append(view[low : low + offsets[stop] - offsets[start]])
        found.append(tuple(views))
    return found


def _same_bounds(runs: list[Run], other: list[Run]) -> bool:
    return len(runs) == len(other) and all(a[0] == b[0] for a, b in zip(runs, other, strict=True))
