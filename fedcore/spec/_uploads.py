"""What one client's upload may do to the model (spec.uploads): the bounds every plaintext
server checks before it accepts an upload (fedcore/protocols/_bounds.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedcore.spec._base import EXACT_FLOAT_INTEGERS, SpecModel

DEFAULT_UPDATE_RMS = 10.0
"""The default bound on one client's update, as a root-mean-square per parameter: an update
whose L2 norm passes ``DEFAULT_UPDATE_RMS * sqrt(parameters)`` is refused."""

DEFAULT_EXAMPLES_OVER_MEDIAN = 10
"""With data the server cannot count (``ByFile``) and no ``maxExamples``, a client's claimed
example count weighs at most this many times the round's median claim."""


class UploadsSpec(SpecModel):
    """Bounds on one client's upload: how far it may move the model and how much it may weigh."""

    max_update_norm: float | None = Field(
        None,
        gt=0,
        description="maxUpdateNorm bounds the L2 norm of one client's update: the change its "
        "upload asks of the model it was sent (for a gradient upload, the step it would take "
        "at the run's learning rate). An upload past it is refused, counted and logged with "
        "the client's name, and the round goes on without it. Unset (default): 10 x the "
        "square root of the model's parameter count, i.e. a root-mean-square change of 10 "
        "per parameter, far above what a round of honest training moves and far below what "
        "overflows float32.",
    )
    max_examples: int | None = Field(
        None,
        ge=1,
        le=EXACT_FLOAT_INTEGERS - 1,
        description="maxExamples caps the example count a client claims, which ShardSize "
        "weighting weighs it by, when the server cannot count the client's data itself "
        "(spec.data.partition.kind ByFile). With a partition the server derives from the "
        "spec, a claim past the client's shard size is refused. Unset "
        "(default): a claim weighs at most 10 x the round's median claim.",
    )
    storage: Literal["Auto", "Memory", "Disk"] = Field(
        "Auto",
        description="storage is where an averaging server keeps a round's uploads until it "
        "combines them. Memory: each upload is added into a float64 sum as it arrives (the "
        "server holds the model, the sum, twice a float32 model's bytes, and the upload it "
        "checks: about 4 models). Disk: each upload goes to a file in the server's run folder "
        "as it arrives and the mean is added up from the files a block at a time (about 2 "
        "models: the model and the upload it checks, then the old and the new model; K "
        "model-sized files on disk for a round of K clients), with the same bits. Auto "
        "(default): Disk where the server's memory (its container's limit, else the "
        "machine's available memory) would not hold 4 models and 300 MiB, else Memory. "
        "Robust aggregators keep every upload on disk under Disk.",
    )
