"""The comparison's workloads: model, data, loss, validation metric, target, budget.

- `digits-cnn`: the demo's CNN (two convolutions, a linear layer) on the digits,
  batch 64; validation accuracy ≥ 0.97 within 400 steps, evaluated every 20.
- `digits-vit`: a ViT (2×2 patches, 2 blocks of width 32) on the digits, batch 32;
  validation accuracy ≥ 0.93 within 400 steps, every 20.
- `stdlib-lm`: a causal character transformer (2 blocks of width 48, context 32)
  on Python source, 16 windows per batch; validation bits per character ≤ 3.2
  within 400 steps, every 25.
- `sbm-gcn`: two `GCNConv` layers on a stochastic-block-model graph, full batch;
  validation accuracy ≥ 0.78 within 150 steps, every 5.
- `teacher-mlp`: a tanh MLP 32-128-128-8 regressing a random teacher on fresh
  inputs, batch 128; validation relative MSE ≤ 0.1 within 400 steps, every 20.

(`WORKLOADS` holds the numbers; the data are described in `compare.data`, the
models in `compare.models`.) A target is about what AdamW or SGD with a
hand-picked learning rate reached after half to three quarters of the budget in
calibration runs (before any study); the budget and the evaluation period are
fixed. The relative
MSE is the mean squared error divided by the variance of the validation targets.

A workload builds a fresh `Problem` for a seed: the seed draws the initial weights
(through `torch.manual_seed`) and the order of the mini-batches (through its own
generator), so two runs with the same seed are identical.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from singd_curvlinops.compare import data, models


@dataclass
class Problem:
    """One run's model, training loss and validation metric.

    Attributes:
        model: The network, freshly initialised from the run's seed.
        loss: Draws the next mini-batch and returns its training loss (forward pass
            only; the caller runs backward and the optimizer).
        evaluate: Returns the validation metric of the model's current weights
            (without gradients, in float32).
    """

    model: nn.Module
    loss: Callable[[], Tensor]
    evaluate: Callable[[], float]


@dataclass(frozen=True)
class Workload:
    """A workload of the comparison.

    Attributes:
        name: Its name on the command line.
        description: One line for tables and help.
        metric: The validation metric's name.
        higher_is_better: Whether larger metric values are better.
        target: The validation target that ends the clock.
        steps: Step budget.
        eval_every: Evaluation period in steps.
        loss_average: SINGD's `loss_average` for the training loss.
        bf16_tolerance: A bfloat16 run whose final metric is worse than its float32
            counterpart by more than this has degraded.
        build: Returns the `Problem` of a seed.
        requires: Importable modules its data or model need beyond the core
            package.
    """

    name: str
    description: str
    metric: str
    higher_is_better: bool
    target: float
    steps: int
    eval_every: int
    loss_average: str
    bf16_tolerance: float
    build: Callable[[int], Problem]
    requires: tuple[str, ...] = ()

    def reached(self, value: float) -> bool:
        """Return whether a metric value meets the target (False for NaN).

        Args:
            value: A validation metric.

        Returns:
            Whether it is at least as good as `target`.
        """
        if self.higher_is_better:
            return value >= self.target
        return value <= self.target

    def worse_by(self, value: float, reference: float) -> float:
        """Return how much worse `value` is than `reference` (negative: better).

        Args:
            value: A metric value.
            reference: Another one.

        Returns:
            The difference in the metric's units, oriented so that positive is worse;
            infinite if `value` is NaN and `reference` is not.
        """
        if math.isnan(value) and not math.isnan(reference):
            return math.inf
        return reference - value if self.higher_is_better else value - reference


def _epochs(n: int, batch_size: int, generator: torch.Generator) -> Iterator[Tensor]:
    """Yield index batches of random permutations of `range(n)`, epoch after epoch.

    Args:
        n: Number of examples.
        batch_size: Batch size; an incomplete last batch of an epoch is dropped.
        generator: Draws the permutations.

    Yields:
        Index tensors `[batch_size]`.
    """
    while True:
        order = torch.randperm(n, generator=generator)
        yield from order[: n // batch_size * batch_size].view(-1, batch_size)


def _classification(
    model: nn.Module, split: data.Split, batch_size: int, seed: int
) -> Problem:
    """Return a classification problem with cross-entropy and validation accuracy.

    Args:
        model: The network (seeded by the caller).
        split: The data.
        batch_size: Mini-batch size.
        seed: Seed of the mini-batch order.

    Returns:
        The problem.
    """
    batches = _epochs(
        len(split.y_train), batch_size, torch.Generator().manual_seed(seed)
    )

    def loss() -> Tensor:
        """Return the mean cross-entropy of the next mini-batch."""
        index = next(batches)
        return F.cross_entropy(
            model(split.X_train[index]).float(), split.y_train[index]
        )

    def evaluate() -> float:
        """Return the validation accuracy."""
        logits = model(split.X_val)
        return (logits.argmax(-1) == split.y_val).float().mean().item()

    return Problem(model, loss, evaluate)


def _digits_cnn(seed: int) -> Problem:
    """Return the demo's CNN on the digits.

    Args:
        seed: Seed of the weights and the batch order.

    Returns:
        The problem.
    """
    from singd_curvlinops.demo.training import make_model

    return _classification(make_model(seed), data.digits(), 64, seed)


def _digits_vit(seed: int) -> Problem:
    """Return the ViT on the digits.

    Args:
        seed: Seed of the weights and the batch order.

    Returns:
        The problem.
    """
    torch.manual_seed(seed)
    return _classification(models.VisionTransformer(), data.digits(), 32, seed)


def _stdlib_lm(
    seed: int, batch_size: int = 16, context: int = 32, val_windows: int = 128
) -> Problem:
    """Return the character-level language model on Python source.

    Training windows start at uniformly random positions of the training text;
    validation covers the start of the validation text in consecutive windows.

    Args:
        seed: Seed of the weights and the windows.
        batch_size: Windows per mini-batch.
        context: Characters per window.
        val_windows: Validation windows (`val_windows * context` characters).

    Returns:
        The problem; its metric is the validation loss in bits per character.
    """
    corpus = data.stdlib_corpus()
    torch.manual_seed(seed)
    model = models.CharTransformer(data.VOCABULARY, context, dim=48)
    generator = torch.Generator().manual_seed(seed)
    windows = torch.arange(context + 1)
    val_count = min(val_windows, (len(corpus.val) - 1) // context)
    val = corpus.val[torch.arange(val_count)[:, None] * context + windows]

    def loss() -> Tensor:
        """Return the mean next-character cross-entropy of the next windows."""
        starts = torch.randint(
            len(corpus.train) - context, (batch_size,), generator=generator
        )
        text = corpus.train[starts[:, None] + windows]
        logits = model(text[:, :-1]).float()
        return F.cross_entropy(logits.flatten(0, 1), text[:, 1:].flatten())

    def evaluate() -> float:
        """Return the validation cross-entropy in bits per character."""
        logits = model(val[:, :-1])
        nats = F.cross_entropy(logits.flatten(0, 1), val[:, 1:].flatten())
        return nats.item() / math.log(2)

    return Problem(model, loss, evaluate)


def _sbm_gcn(seed: int) -> Problem:
    """Return the GCN on the stochastic-block-model graph (full batch).

    Args:
        seed: Seed of the weights.

    Returns:
        The problem.
    """
    graph = data.sbm_graph()
    torch.manual_seed(seed)
    model = models.GCN(graph.x.shape[1], 32, int(graph.y.max()) + 1)

    def loss() -> Tensor:
        """Return the mean cross-entropy on the labelled nodes."""
        scores = model(graph.x, graph.edge_index).float()
        return F.cross_entropy(scores[graph.train_mask], graph.y[graph.train_mask])

    def evaluate() -> float:
        """Return the accuracy on the validation nodes."""
        predicted = model(graph.x, graph.edge_index).argmax(-1)
        mask = graph.val_mask
        return (predicted[mask] == graph.y[mask]).float().mean().item()

    return Problem(model, loss, evaluate)


def _teacher_mlp(seed: int, batch_size: int = 128) -> Problem:
    """Return the student MLP that regresses the teacher's outputs.

    Every step draws fresh standard normal inputs (from the run's seed) and labels
    them with the teacher: there is no finite training set to overfit.

    Args:
        seed: Seed of the weights and the inputs.
        batch_size: Mini-batch size.

    Returns:
        The problem; its metric is the validation MSE over the targets' variance.
    """
    teacher = data.teacher()
    X_val, y_val = data.teacher_validation()
    torch.manual_seed(seed)
    model = models.mlp((32, 128, 128, 8))
    generator = torch.Generator().manual_seed(seed)
    variance = y_val.var().item()

    def loss() -> Tensor:
        """Return the mean squared error on fresh inputs."""
        X = torch.randn(batch_size, 32, generator=generator)
        with torch.no_grad():
            y = teacher(X)
        return F.mse_loss(model(X).float(), y)

    def evaluate() -> float:
        """Return the validation MSE relative to the targets' variance."""
        return F.mse_loss(model(X_val), y_val).item() / variance

    return Problem(model, loss, evaluate)


_ACCURACY = {"metric": "validation accuracy", "higher_is_better": True}
WORKLOADS: dict[str, Workload] = {
    workload.name: workload
    for workload in (
        Workload(
            "digits-cnn",
            "the demo's CNN on the digits",
            **_ACCURACY,
            target=0.97,
            steps=400,
            eval_every=20,
            loss_average="batch",
            bf16_tolerance=0.02,
            build=_digits_cnn,
            requires=("sklearn",),
        ),
        Workload(
            "digits-vit",
            "a small ViT on the digits",
            **_ACCURACY,
            target=0.93,
            steps=400,
            eval_every=20,
            loss_average="batch",
            bf16_tolerance=0.02,
            build=_digits_vit,
            requires=("sklearn",),
        ),
        Workload(
            "stdlib-lm",
            "a character transformer on Python source",
            metric="validation bits per character",
            higher_is_better=False,
            target=3.2,
            steps=400,
            eval_every=25,
            loss_average="batch+sequence",
            bf16_tolerance=0.05,
            build=_stdlib_lm,
        ),
        Workload(
            "sbm-gcn",
            "a GCN on a stochastic-block-model graph",
            **_ACCURACY,
            target=0.78,
            steps=150,
            eval_every=5,
            loss_average="batch",
            bf16_tolerance=0.02,
            build=_sbm_gcn,
            requires=("torch_geometric",),
        ),
        Workload(
            "teacher-mlp",
            "a student MLP regressing a random teacher",
            metric="validation relative MSE",
            higher_is_better=False,
            target=0.1,
            steps=400,
            eval_every=20,
            loss_average="batch",
            bf16_tolerance=0.02,
            build=_teacher_mlp,
        ),
    )
}
