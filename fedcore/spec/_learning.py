"""The model every party trains, how each client trains it, and how the server evaluates it."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from fedcore.spec._base import SpecModel


class ModelSpec(SpecModel):
    """The network every party trains."""

    kind: Literal["MLP", "CNN", "Import"] = Field(
        "MLP",
        description="kind of network. MLP (default): fully connected layers. CNN: a small "
        "convolutional network. Import: a user model built by importPath.",
    )
    hidden: list[Annotated[int, Field(ge=1, le=1_000_000)]] = Field(
        default_factory=lambda: [128],
        max_length=64,
        description="hidden lists the widths of the MLP's hidden layers, input to output. "
        "Default [128]. Only for kind MLP.",
    )
    activation: Literal["ReLU", "Tanh", "Sigmoid"] = Field(
        "ReLU", description="activation after every hidden layer. Default ReLU."
    )
    bias: bool = Field(True, description="bias adds a bias vector to every layer. Default true.")
    channels: list[Annotated[int, Field(ge=1, le=4096)]] = Field(
        default_factory=lambda: [16, 32],
        min_length=1,
        max_length=8,
        description="channels lists the output channels of the CNN's 3x3 convolution blocks. "
        "Default [16, 32]. Only for kind CNN.",
    )
    import_path: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$",
        description="importPath names a factory 'package.module:function' that takes "
        "(input_shape, num_classes) and returns a torch.nn.Module. Required for kind Import.",
    )
    dtype: Literal["float32", "float64"] = Field(
        "float32", description="dtype of the parameters and the maths. Default float32."
    )


class OptimizerSpec(SpecModel):
    """The clients' local optimizer (fresh every round)."""

    kind: Literal["SGD", "Adam"] = Field("SGD", description="kind of optimizer. Default SGD.")
    learning_rate: float = Field(
        0.1, gt=0, le=100, description="learningRate of the optimizer. Default 0.1."
    )
    momentum: float = Field(
        0.0, ge=0, lt=1, description="momentum of SGD. Default 0 (none). Ignored for Adam."
    )
    weight_decay: float = Field(
        0.0, ge=0, le=1, description="weightDecay (L2) of the optimizer. Default 0."
    )


class TrainingSpec(SpecModel):
    """What each client does with the model it receives."""

    local_epochs: int = Field(
        1,
        ge=1,
        le=1000,
        description="localEpochs is the number of passes over the local shard per round "
        "(fedavg). Default 1. fedsgd always takes one full-shard gradient.",
    )
    batch_size: int = Field(
        32, ge=1, le=1_000_000, description="batchSize of local training. Default 32."
    )
    optimizer: OptimizerSpec = Field(
        default_factory=OptimizerSpec, description="optimizer for local training."
    )
    loss: Literal["CrossEntropy", "MSE"] = Field(
        "CrossEntropy",
        description="loss of training. CrossEntropy (default) on logits; MSE against one-hot "
        "targets.",
    )


class EvaluationSpec(SpecModel):
    """When and where the global model is scored: on the server's held-out split, or on each
    client's own."""

    where: Literal["Server", "Clients", "Both"] | None = Field(
        None,
        description="where evaluation runs. Server: on the held-out split of spec.data.source, "
        "on the server. Clients: the server sends the models to the clients, each scores them "
        "on its own held-out examples (with spec.data.clientData; else its block of the shared "
        "test split) and answers with counts, which the server sums; protocols whose clients "
        "never hold the true model refuse it. Both (shared source only): each, the clients' "
        "sum reported as the run's accuracy and the server's as serverAccuracy; with a shared "
        "source the two are equal, a check. Default: Clients with spec.data.clientData, else "
        "Server.",
    )
    per_class: bool = Field(
        False,
        description="perClass also reports, per label, the examples scored and those right "
        "(clients' evaluation only). Default false.",
    )

    every_rounds: int = Field(
        1,
        ge=0,
        description="everyRounds evaluates after every k-th round and after the last. "
        "Default 1; 0 evaluates only after the last round.",
    )
    release_final_model: bool = Field(
        True,
        description="releaseFinalModel writes the final global model to the run folder "
        "(model.safetensors). Default true.",
    )
