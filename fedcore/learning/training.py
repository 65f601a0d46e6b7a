"""Local training and evaluation: what a client does with a model, and how the server scores it."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedcore.learning._memory import trim
from fedcore.learning.data import ArrayDataset
from fedcore.learning.models import get_weights, release_storage, set_weights
from fedcore.spec import TrainingSpec

log = logging.getLogger(__name__)

RESIDENT_BYTES_ENV = "FEDCORE_RESIDENT_BYTES"
"""Overrides :data:`RESIDENT_BYTES` (bytes)."""

RESIDENT_BYTES = 1 << 30
"""A shard mapped from the data cache whose features take more bytes than this is streamed:
each batch is read from the map when it is used, instead of the whole shard being copied into
memory (and onto the device) once."""

LARGE_MODEL_BYTES = 64 * 1024 * 1024
"""Models of at least this many bytes step each parameter during the backward pass and drop
its gradient there (``LocalLearner(step_in_backward=...)``), and an ``in_place`` learner lets
go of such a model's own memory at once (every call loads the weights it is given): below it,
a hook per parameter costs more than the gradients' memory is worth."""

_TORCH_SEED_TAG = 0x7F
"""Appended to the shuffle's seed words to seed torch's RNG (dropout) apart from the shuffle."""


@dataclass(frozen=True)
class LocalStats:
    """What a client reports about its local work in one round.

    Attributes:
        num_examples: the size of the client's shard (the weight of ShardSize averaging).
        loss: the mean training loss over the examples seen (for a gradient: at the weights
            received).
        steps: the number of optimizer steps taken (1 for a gradient).
    """

    num_examples: int
    loss: float
    steps: int


@dataclass(frozen=True)
class EvalResult:
    """The score of a model on a data set.

    Attributes:
        loss: the mean loss over the examples (the training loss's definition).
        accuracy: the share of examples whose largest logit is the label's.
        num_examples: the number of examples scored.
    """

    loss: float
    accuracy: float
    num_examples: int


@dataclass(frozen=True)
class EvalCounts:
    """What scoring a model on some examples counts: sums, so that parts add up exactly.

    Attributes:
        total: the examples scored.
        correct: those whose largest logit is the label's.
        loss_sum: the summed loss (the training loss's definition, per example), float64.
        class_total: per class, the examples scored (empty unless asked for).
        class_correct: per class, those right (empty unless asked for).
    """

    total: int
    correct: int
    loss_sum: float
    class_total: tuple[int, ...] = ()
    class_correct: tuple[int, ...] = ()

    def result(self) -> EvalResult:
        """The mean loss and accuracy these counts give (NaN when nothing was scored)."""
        if self.total == 0:
            return EvalResult(float("nan"), float("nan"), 0)
        return EvalResult(self.loss_sum / self.total, self.correct / self.total, self.total)


class LocalLearner:
    """Trains a model on one client's shard, starting from weights it is given each round.

    The shard is converted to tensors once, on ``device`` and in the model's dtype. Every call
    starts from the weights passed in and a fresh optimizer, so rounds do not share state.

    Args:
        model: the network; it is moved to ``device`` and its weights are overwritten on
            every call.
        data: the client's shard; must not be empty.
        training: the manifest's ``spec.training``.
        seed: the run's seed (``spec.seed``).
        client_index: the client's index, from 0.
        device: the torch device to train on.
        in_place: the caller owns the weights it passes to ``train``: for a large model (at
            least ``LARGE_MODEL_BYTES``, on the CPU) a call that says it is done with them
            (``consume``) trains in those arrays instead of a copy, so that a client holds
            its model's bytes once, not twice or three times (a small model copies: cheaper
            per call than re-pointing its tensors). A client role's decoded task is its own; a
            simulation's is the server's, shared by every client, and must not be lent. A
            large model's own memory is let go at once (``release_storage``): its first task
            brings it.
        step_in_backward: step each parameter as soon as its gradient is complete, during the
            backward pass, and drop that gradient at once (one optimizer per parameter; the
            same numbers, bit for bit), so that a large model's gradients are never all held
            together. None: for models of at least ``LARGE_MODEL_BYTES``.

    Raises:
        ValueError: if ``data`` is empty or ``seed`` or ``client_index`` is negative.
    """

    def __init__(
        self,
        model: nn.Module,
        data: ArrayDataset,
        training: TrainingSpec,
        *,
        seed: int,
        client_index: int,
        device: str = "cpu",
        in_place: bool = False,
        step_in_backward: bool | None = None,
    ) -> None:
        if len(data) == 0:
            raise ValueError(f"Client {client_index} has no training examples.")
        if seed < 0 or client_index < 0:
            raise ValueError(
                f"The seed and client index must be non-negative, got {seed} and {client_index}."
            )
        self._device = torch.device(device)
        self._model = model.to(self._device)
        self._model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        large = self._model_bytes >= LARGE_MODEL_BYTES
        # A small model copies: re-pointing its tensors costs more per call than the copy.
        self._in_place = in_place and large and self._device.type == "cpu"
        if self._in_place:
            release_storage(self._model)  # a large model's bytes come with its first task
        if step_in_backward is None:
            step_in_backward = large
        self._step_in_backward = step_in_backward
        self._backward_steps: _BackwardSteps | None = None
        self._training = training
        self._seed = seed
        self._client_index = client_index
        self._dtype = _model_dtype(model)
        self._classes = data.num_classes
        self._optimizer: torch.optim.Optimizer | None = None
        self._mapped: np.ndarray | None = None
        if isinstance(data.x, np.memmap) and data.x.nbytes > _resident_bytes():
            # Streamed: batches are read from the cache's map as they are used.
            self._mapped = data.x
            self._y = torch.tensor(data.y, dtype=torch.int64, device=self._device)
            self._x = self._targets = torch.empty(0)
            log.info(
                "Client %d's shard (%d examples, %.0f MB) is streamed from the data cache.",
                client_index,
                len(data),
                data.x.nbytes / 1e6,
            )
        else:
            self._x, self._y, self._targets = _as_tensors(model, data, self._device)

    @property
    def num_examples(self) -> int:
        """The number of examples in the client's shard."""
        return int(self._y.shape[0])

    @property
    def streamed(self) -> bool:
        """Whether the shard is read from the data cache batch by batch (too large to hold)."""
        return self._mapped is not None

    @property
    def model(self) -> nn.Module:
        """The network (its weights are whatever the last call loaded)."""
        return self._model

    @property
    def features(self) -> torch.Tensor:
        """The shard's inputs, on the learner's device, in the model's dtype.

        A streamed shard is read whole into memory by the first call (and kept): the
        closed-form protocols that need it as one matrix (mpdp, perturb, lppa) cannot
        stream it.
        """
        self._hold_whole()
        return self._x

    @property
    def labels(self) -> torch.Tensor:
        """The shard's integer labels, on the learner's device."""
        return self._y

    @property
    def targets(self) -> torch.Tensor:
        """The shard's one-hot targets in the model's dtype (the MSE loss's targets)."""
        self._hold_whole()
        return self._targets

    def batch(self, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The inputs, labels and one-hot targets of ``rows`` (None: the whole shard), on the
        learner's device, in that order; read from the map when the shard is streamed."""
        if self._mapped is None:
            if rows is None:
                return self._x, self._y, self._targets
            return self._x[rows], self._y[rows], self._targets[rows]
        if rows is None:
            return self.features, self._y, self.targets
        index = rows.to("cpu").numpy()
        x = torch.from_numpy(np.take(self._mapped, index, axis=0))
        x = x.to(device=self._device, dtype=self._dtype)
        y = self._y[rows]
        return x, y, F.one_hot(y, num_classes=self._classes).to(self._dtype)

    def _hold_whole(self) -> None:
        """Reads a streamed shard into memory, once."""
        if self._mapped is not None and self._x.numel() == 0 and self.num_examples:
            log.warning(
                "Client %d's protocol needs its whole shard as one matrix: reading the "
                "streamed shard into memory.",
                self._client_index,
            )
            x = torch.tensor(np.asarray(self._mapped), dtype=self._dtype, device=self._device)
            self._x = x
            self._targets = F.one_hot(self._y, num_classes=self._classes).to(self._dtype)

    def train(
        self,
        weights: dict[str, np.ndarray],
        *,
        round: int,
        epochs: int | None = None,
        consume: bool = False,
    ) -> tuple[dict[str, np.ndarray], LocalStats]:
        """Trains from ``weights`` for some epochs of minibatch steps.

        Each epoch visits the shard in an order drawn from
        ``np.random.default_rng([seed, round, client_index])`` (one permutation per epoch,
        from the same generator) in batches of ``training.batch_size``; the last batch may be
        smaller.

        Args:
            weights: the starting weights, as :func:`fedcore.learning.models.get_weights` returns;
                not changed, unless ``consume``.
            round: the round number, from 0; it seeds the shuffle.
            epochs: the number of epochs; ``training.local_epochs`` when None.
            consume: the caller does not read ``weights`` again: a learner made ``in_place``
                then trains in those arrays (they change) and returns views of them; others
                copy as always. The numbers are the same either way.

        Returns:
            The trained weights (copies, or with ``consume`` on an ``in_place`` learner the
            arrays passed in, trained) and the round's statistics.

        Raises:
            ValueError: if ``weights`` do not fit the model, ``round`` is negative or
                ``epochs`` is below 1.
        """
        epochs = self._training.local_epochs if epochs is None else epochs
        if epochs < 1:
            raise ValueError(f"The number of local epochs must be at least 1, got {epochs}.")
        self._check_round(round)
        in_place = consume and self._in_place
        state = set_weights(self._model, weights, in_place=in_place)
        if not self._model.training:  # train() and eval() set every submodule
            self._model.train()
        stepper = self._fresh_backward_steps() if self._step_in_backward else None
        optimizer = None if stepper is not None else self._fresh_optimizer()
        order = np.random.default_rng([self._seed, round, self._client_index])
        n = self.num_examples
        batch_size = self._training.batch_size
        losses: list[torch.Tensor] = []
        sizes: list[int] = []
        steps = 0
        with self._forked_rng(round):
            for _ in range(epochs):
                permutation = torch.from_numpy(order.permutation(n)).to(self._device)
                for start in range(0, n, batch_size):
                    rows = permutation[start : start + batch_size]
                    x, y, targets = self.batch(rows)
                    if optimizer is not None:
                        _drop_gradients(optimizer)
                        loss = self._loss(self._model(x), y, targets)
                        loss.backward()
                        optimizer.step()
                    else:
                        loss = self._loss(self._model(x), y, targets)
                        assert stepper is not None
                        with stepper.stepping():
                            loss.backward()
                    losses.append(loss.detach())
                    sizes.append(len(rows))
                    steps += 1
        # The gradients and the optimizer's state (Adam's: twice the model) are let go before
        # the weights are copied out: a client holds its model's bytes a few times, not more.
        if optimizer is not None:
            _drop_gradients(optimizer)
            optimizer.state.clear()
        else:
            assert stepper is not None
            stepper.clear()
        if self._device.type == "cpu":
            trim(self._model_bytes)  # the gradients' pages, before the next model arrives
        per_step = torch.stack(losses).to("cpu", torch.float64).numpy()
        mean_loss = float(np.dot(per_step, np.asarray(sizes, dtype=np.float64))) / (epochs * n)
        trained = get_weights(self._model, state, copy=not in_place)
        return trained, LocalStats(n, mean_loss, steps)

    def gradient(
        self, weights: dict[str, np.ndarray], *, round: int
    ) -> tuple[dict[str, np.ndarray], LocalStats]:
        """Returns the gradient of the mean loss over the whole shard at ``weights``.

        The shard is one full batch. Weight decay is not part of the loss, so it is not in
        the gradient.

        Args:
            weights: the point to differentiate at; not changed.
            round: the round number, from 0; it seeds torch's RNG (dropout, if any).

        Returns:
            One gradient array per weight name, in the weights' order, shapes and dtypes
            (zeros for buffers and frozen parameters), and the statistics (loss at
            ``weights``, steps 1).

        Raises:
            ValueError: if ``weights`` do not fit the model or ``round`` is negative.
        """
        self._check_round(round)
        set_weights(self._model, weights)  # a model that viewed lent arrays gets its own
        self._model.train()
        self._model.zero_grad(set_to_none=True)
        with self._forked_rng(round):
            if self._mapped is None:
                loss = self._loss(self._model(self._x), self._y, self._targets)
                loss.backward()
            else:  # the mean over the shard, summed from blocks: the same gradient, streamed
                loss = torch.zeros((), dtype=torch.float64, device=self._device)
                n = self.num_examples
                for start in range(0, n, _STREAM_BLOCK):
                    rows = torch.arange(start, min(start + _STREAM_BLOCK, n))
                    x, y, targets = self.batch(rows)
                    part = self._loss(self._model(x), y, targets) * (len(rows) / n)
                    part.backward()
                    loss += part.detach().to(torch.float64)
        parameters = dict(self._model.named_parameters(remove_duplicate=False))
        gradients: dict[str, np.ndarray] = {}
        for name, tensor in self._model.state_dict().items():
            grad = parameters[name].grad if name in parameters else None
            source = torch.zeros_like(tensor) if grad is None else grad
            gradients[name] = source.detach().to("cpu", copy=True).numpy()
        self._model.zero_grad(set_to_none=True)
        return gradients, LocalStats(self.num_examples, float(loss.item()), 1)

    def _loss(
        self, logits: torch.Tensor, labels: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        """The mean training loss of ``logits`` against the batch's labels (or targets)."""
        if self._training.loss == "MSE":
            return F.mse_loss(logits, targets)
        return F.cross_entropy(logits, labels)

    def views(self, buffer: bytearray) -> bool:
        """Whether the model's parameters are views of ``buffer`` (it trained in a task
        decoded there, ``consume``)."""
        if not len(buffer):
            return False
        start = np.frombuffer(buffer, dtype=np.uint8).ctypes.data
        end = start + len(buffer)
        parameters = list(self._model.parameters())
        return bool(parameters) and all(start <= p.data_ptr() < end for p in parameters)

    def _check_round(self, round: int) -> None:
        """Refuses a negative round, which cannot seed a generator."""
        if round < 0:
            raise ValueError(f"The round must be non-negative, got {round}.")

    def _fresh_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer of one call, as freshly made: the learner's own, its state (momenta,
        Adam's moments and step) emptied. Building one per call cost more than a small
        model's whole step."""
        if self._optimizer is None:
            self._optimizer = _optimizer(self._model, self._training)
        else:
            self._optimizer.state.clear()
        return self._optimizer

    def _fresh_backward_steps(self) -> _BackwardSteps:
        """The per-parameter optimizers of one call (``step_in_backward``), as freshly made."""
        if self._backward_steps is None:
            self._backward_steps = _BackwardSteps(self._model, self._training)
        else:
            self._backward_steps.clear()
        return self._backward_steps

    @contextlib.contextmanager
    def _forked_rng(self, round: int) -> Iterator[None]:
        """Seeds torch's RNG from (seed, round, client) and restores the global one after
        (what ``torch.random.fork_rng`` does, for the generators in use only)."""
        seed = int(
            np.random.SeedSequence(
                [self._seed, round, self._client_index, _TORCH_SEED_TAG]
            ).generate_state(1, np.uint64)[0]
        )
        cuda = self._device.type == "cuda"
        saved = torch.default_generator.get_state()
        saved_cuda = torch.cuda.get_rng_state(self._device) if cuda else None
        try:
            # Seed only the generators in use: torch.manual_seed also queues lazy seeding of
            # every accelerator backend, which costs a stack capture each (0.4 ms per call).
            torch.default_generator.manual_seed(seed)
            if cuda:
                torch.cuda.manual_seed(seed)
            yield
        finally:
            torch.default_generator.set_state(saved)
            if saved_cuda is not None:
                torch.cuda.set_rng_state(saved_cuda, self._device)


class Evaluator:
    """Scores weights on a fixed data set (the server's test split), without gradients.

    Args:
        model: the network; it is moved to ``device`` and its weights are overwritten.
        data: the examples to score; must not be empty.
        training: the manifest's ``spec.training`` (for its loss).
        device: the torch device to score on.
        batch_size: the number of examples per forward pass.
        allow_empty: take an empty data set (a client without held-out rows counts zeros).
        own_model: the model is the evaluator's alone: on the CPU it scores the weights it is
            given in place (borrowed, not copied) and holds no storage of its own between
            scores, so a server holds its model's bytes once, not twice.

    Raises:
        ValueError: if ``data`` is empty (unless ``allow_empty``) or ``batch_size`` is below 1.
    """

    def __init__(
        self,
        model: nn.Module,
        data: ArrayDataset,
        training: TrainingSpec,
        *,
        device: str = "cpu",
        batch_size: int = 2048,
        allow_empty: bool = False,
        own_model: bool = False,
    ) -> None:
        if len(data) == 0 and not allow_empty:
            raise ValueError("The evaluation data set has no examples.")
        if batch_size < 1:
            raise ValueError(f"The evaluation batch size must be at least 1, got {batch_size}.")
        self._device = torch.device(device)
        self._model = model.to(self._device)
        self._training = training
        self._batch_size = batch_size
        self._x, self._y, self._targets = _as_tensors(model, data, self._device)
        self._borrow = own_model and self._device.type == "cpu"
        if self._borrow:
            self._model.to_empty(device="meta")  # shapes and dtypes kept, storage let go

    def evaluate(
        self, weights: dict[str, np.ndarray], *, rows: tuple[int, int] | None = None
    ) -> EvalResult:
        """Scores ``weights`` on the data set.

        Args:
            weights: the weights to score; not changed.
            rows: score only rows [start, stop) (default: all).

        Returns:
            The mean loss, the accuracy and the number of examples.

        Raises:
            ValueError: if ``weights`` do not fit the model.
        """
        return self.counts(weights, rows=rows).result()

    def counts(
        self,
        weights: dict[str, np.ndarray],
        *,
        rows: tuple[int, int] | None = None,
        per_class: bool = False,
    ) -> EvalCounts:
        """Scores ``weights`` on the data set and returns the counts (sums, not means).

        Args:
            weights: the weights to score; not changed.
            rows: score only rows [start, stop) (default: all).
            per_class: also count, per class, the examples and those right.

        Raises:
            ValueError: if ``weights`` do not fit the model.
        """
        set_weights(self._model, weights, borrow=self._borrow)
        try:
            return self._counts(rows, per_class)
        finally:
            if self._borrow:
                self._model.to_empty(device="meta")  # lets go of the borrowed weights

    def _counts(self, rows: tuple[int, int] | None, per_class: bool) -> EvalCounts:
        self._model.eval()
        first, last = (0, int(self._y.shape[0])) if rows is None else rows
        classes = int(self._targets.shape[1])
        total = torch.zeros((), dtype=torch.float64, device=self._device)
        correct = torch.zeros((), dtype=torch.int64, device=self._device)
        class_total = torch.zeros(classes, dtype=torch.int64, device=self._device)
        class_correct = torch.zeros(classes, dtype=torch.int64, device=self._device)
        with torch.no_grad():
            for start in range(first, last, self._batch_size):
                stop = min(start + self._batch_size, last)
                logits = self._model(self._x[start:stop])
                labels = self._y[start:stop]
                if self._training.loss == "MSE":
                    targets = self._targets[start:stop]
                    # The mean over all n * classes entries, as the training loss.
                    batch = F.mse_loss(logits, targets, reduction="sum") / targets.shape[1]
                else:
                    batch = F.cross_entropy(logits, labels, reduction="sum")
                total += batch.to(torch.float64)
                right = logits.argmax(dim=1) == labels
                correct += right.sum()
                if per_class:
                    class_total += torch.bincount(labels, minlength=classes)
                    class_correct += torch.bincount(labels[right], minlength=classes)
        return EvalCounts(
            total=last - first,
            correct=int(correct.item()),
            loss_sum=float(total.item()),
            class_total=tuple(int(v) for v in class_total.tolist()) if per_class else (),
            class_correct=tuple(int(v) for v in class_correct.tolist()) if per_class else (),
        )

    def evaluate_models(
        self, models: Sequence[dict[str, np.ndarray]], parts: int = 1
    ) -> EvalResult:
        """Scores a protocol's models (``ServerProtocol.models()``).

        One model: as ``evaluate``. Several (a clustered protocol's): the data set is ``parts``
        equal consecutive blocks (one per data cluster, ``spec.data.clusters``); each block is
        scored by the model with the lowest loss on it (IFCA's rule), and the result is the
        mean over the blocks, weighted by their sizes.
        """
        if len(models) == 1:
            return self.evaluate(models[0])
        n = int(self._y.shape[0])
        bounds = np.linspace(0, n, max(1, parts) + 1).astype(int)
        loss = accuracy = 0.0
        for first, last in itertools.pairwise(bounds):
            if last <= first:
                continue
            scores = [self.evaluate(w, rows=(int(first), int(last))) for w in models]
            best = min(scores, key=lambda r: r.loss)
            loss += best.loss * best.num_examples
            accuracy += best.accuracy * best.num_examples
        return EvalResult(loss / n, accuracy / n, n)


_STREAM_BLOCK = 4096
"""Examples per block when a streamed shard's full gradient is summed."""


def _resident_bytes() -> int:
    """The size above which a mapped shard is streamed (:data:`RESIDENT_BYTES`)."""
    named = os.environ.get(RESIDENT_BYTES_ENV)
    return int(named) if named and named.isdigit() else RESIDENT_BYTES


def _model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's floating-point parameters (float32 when it has none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _as_tensors(
    model: nn.Module, data: ArrayDataset, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Converts a data set once: features in the model's dtype, labels, one-hot targets."""
    dtype = _model_dtype(model)
    x = torch.tensor(data.x, dtype=dtype, device=device)
    y = torch.tensor(data.y, dtype=torch.int64, device=device)
    targets = F.one_hot(y, num_classes=data.num_classes).to(dtype)
    return x, y, targets


def _drop_gradients(optimizer: torch.optim.Optimizer) -> None:
    """What ``optimizer.zero_grad(set_to_none=True)`` does, without its profiler scope: with a
    small model that scope cost more than a tenth of a client's whole step."""
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            parameter.grad = None


class _BackwardSteps:
    """One optimizer per trainable parameter, stepped by a hook the moment that parameter's
    gradient is complete in a backward pass (``register_post_accumulate_grad_hook``), which
    then drops the gradient: a model's gradients are never all held at once, only those of the
    layers autograd is between. Each parameter's update reads only its own gradient and state
    (SGD with momentum and weight decay, Adam), so the numbers are the whole-model optimizer's,
    bit for bit; autograd computes every use of a parameter's value before its gradient is
    complete (it raises, were a value it saved changed). The hooks act only inside
    ``stepping``: other backward passes on the model (full-shard gradients) are left alone.
    """

    def __init__(self, model: nn.Module, training: TrainingSpec) -> None:
        self._active = False
        self._optimizers: dict[nn.Parameter, torch.optim.Optimizer] = {}
        for parameter in model.parameters():
            if parameter.requires_grad:
                self._optimizers[parameter] = _optimizer_over([parameter], training)
                parameter.register_post_accumulate_grad_hook(self._step)

    def _step(self, parameter: torch.Tensor) -> None:
        if self._active:
            self._optimizers[parameter].step()  # type: ignore[index]
            parameter.grad = None

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """Steps the parameters during the backward passes run inside."""
        self._active = True
        try:
            yield
        finally:
            self._active = False

    def clear(self) -> None:
        """Empties every optimizer's state (momenta, Adam's moments and step) and gradient."""
        for parameter, optimizer in self._optimizers.items():
            optimizer.state.clear()
            parameter.grad = None


def _optimizer(model: nn.Module, training: TrainingSpec) -> torch.optim.Optimizer:
    """A fresh optimizer over the model's trainable parameters."""
    return _optimizer_over([p for p in model.parameters() if p.requires_grad], training)


def _optimizer_over(
    parameters: list[nn.Parameter], training: TrainingSpec
) -> torch.optim.Optimizer:
    """A fresh optimizer of the spec's kind over ``parameters``."""
    spec = training.optimizer
    if spec.kind == "Adam":
        return torch.optim.Adam(parameters, lr=spec.learning_rate, weight_decay=spec.weight_decay)
    return torch.optim.SGD(
        parameters,
        lr=spec.learning_rate,
        momentum=spec.momentum,
        weight_decay=spec.weight_decay,
    )
