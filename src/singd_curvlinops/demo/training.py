"""The demo's data, model and training loop.

Data: scikit-learn's 1,797 handwritten 8×8 digits (bundled with scikit-learn, no
download), pixels scaled to `[0, 1]`, a stratified quarter held out for testing.
Model: two 3×3 convolutions (1→8 with a 2×2 max-pool, 8→16) and a linear
classifier 256→10, i.e. three layers that SINGD and KFAC precondition. Every
optimizer starts from the same weights and sees the mini-batches in the same order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from singd_curvlinops.bench.memory import MIB, state_bytes
from singd_curvlinops.bench.workloads import evaluate_loss, train_step
from singd_curvlinops.demo.optimizers import OptimizerSpec, build_optimizer

TRAIN_EXAMPLES = 1347  # 75% of scikit-learn's 1,797 digits
TEST_EXAMPLES = 450
#: The largest seed `torch.manual_seed` accepts (it reads seeds as 64-bit integers;
#: negative ones alias positive ones and are not used here).
MAX_SEED = 2**64 - 1


@dataclass(frozen=True)
class Digits:
    """The digits, split into training and test set.

    Attributes:
        X_train: Training images `[n_train, 1, 8, 8]`, float32 in `[0, 1]`.
        y_train: Training labels `[n_train]`.
        X_test: Test images `[n_test, 1, 8, 8]`.
        y_test: Test labels `[n_test]`.
    """

    X_train: Tensor
    y_train: Tensor
    X_test: Tensor
    y_test: Tensor


@dataclass
class RunResult:
    """What one optimizer's training run produced.

    Attributes:
        label: The optimizer's row label, e.g. `"SINGD (dense)"`.
        losses: Mini-batch training loss of every step.
        accuracies: Test accuracy before training and after every epoch.
        final_train_loss: Mean loss on the whole training set after training.
        ms_per_step: Wall-clock milliseconds per training step (zero_grad,
            forward, backward, step; evaluation and progress output excluded).
        state_mib: Size of the optimizer's state after training
            (`singd_curvlinops.bench.memory.state_bytes`).
    """

    label: str
    losses: list[float] = field(default_factory=list)
    accuracies: list[float] = field(default_factory=list)
    final_train_loss: float = float("nan")
    ms_per_step: float = float("nan")
    state_mib: float = float("nan")

    @property
    def test_accuracy(self) -> float:
        """The test accuracy after the last epoch.

        Returns:
            A fraction in `[0, 1]`.
        """
        return self.accuracies[-1]


def load_digits_data(train_size: int | None = None) -> Digits:
    """Load scikit-learn's digits and split them 75/25, stratified by label.

    Args:
        train_size: Keep only the first `train_size` training examples (None: all
            `TRAIN_EXAMPLES`).

    Returns:
        The split data; the test set always has `TEST_EXAMPLES`.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    X = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target)
    X_train, X_test, y_train, y_test = train_test_split(
        X, y, test_size=0.25, random_state=0, stratify=y
    )
    return Digits(X_train[:train_size], y_train[:train_size], X_test, y_test)


def make_model(seed: int) -> nn.Module:
    """Return the demo's CNN with weights drawn from `seed`.

    Args:
        seed: Seed of the initial weights.

    Returns:
        The network, mapping `[batch, 1, 8, 8]` images to `[batch, 10]` logits.
    """
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 8×8 -> 4×4
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 10),
    )


def _accuracy(model: nn.Module, X: Tensor, y: Tensor) -> float:
    """Return the fraction of correctly classified examples.

    Args:
        model: The network.
        X: Images.
        y: Labels.

    Returns:
        The accuracy in `[0, 1]`.
    """
    with torch.no_grad():
        return (model(X).argmax(-1) == y).float().mean().item()


def _check_options(epochs: int, batch_size: int, seed: int, n_train: int) -> None:
    """Check the options of `train`.

    Args:
        epochs: Number of epochs.
        batch_size: Mini-batch size.
        seed: Seed.
        n_train: Number of training examples.

    Raises:
        ValueError: If `epochs` < 1, `batch_size` is not in `[1, n_train]`, or
            `seed` is not an int in `[0, MAX_SEED]`.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}.")
    if not 1 <= batch_size <= n_train:
        raise ValueError(
            f"batch_size must be in [1, {n_train}] (the training examples), "
            f"got {batch_size}."
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be an int in [0, 2**64 - 1], got {seed!r}.")


def train(
    spec: OptimizerSpec,
    data: Digits,
    *,
    epochs: int,
    batch_size: int,
    seed: int,
    progress: bool = True,
) -> RunResult:
    """Train a fresh model with one optimizer and record losses, accuracy, cost.

    Each epoch visits the training set in a random order drawn from `seed` (the
    same for every optimizer) in mini-batches of `batch_size`; an incomplete last
    batch is dropped.

    Args:
        spec: The optimizer.
        data: The digits.
        epochs: Number of epochs.
        batch_size: Mini-batch size, at most the number of training examples.
        seed: Seed of the initial weights and of the data order, in
            `[0, MAX_SEED]`.
        progress: Show a tqdm progress bar on standard error.

    Returns:
        The run's result.
    """
    from tqdm import tqdm

    n_train = len(data.y_train)
    _check_options(epochs, batch_size, seed, n_train)
    model = make_model(seed)
    optimizer = build_optimizer(spec, model)
    generator = torch.Generator().manual_seed(seed)
    result = RunResult(spec.label)
    result.accuracies.append(_accuracy(model, data.X_test, data.y_test))
    batches = n_train // batch_size
    seconds = 0.0
    with tqdm(
        total=epochs * batches, desc=spec.label, unit="step", disable=not progress
    ) as bar:
        for _ in range(epochs):
            order = torch.randperm(n_train, generator=generator)
            for index in order[: batches * batch_size].view(batches, batch_size):
                X, y = data.X_train[index], data.y_train[index]
                start = time.perf_counter()
                loss = train_step(model, optimizer, X, y)
                seconds += time.perf_counter() - start
                result.losses.append(loss.item())
                bar.update()
            result.accuracies.append(_accuracy(model, data.X_test, data.y_test))
            bar.set_postfix(
                loss=f"{result.losses[-1]:.3f}", test_acc=f"{result.accuracies[-1]:.3f}"
            )
    result.final_train_loss = evaluate_loss(model, data.X_train, data.y_train)
    result.ms_per_step = 1e3 * seconds / len(result.losses)
    result.state_mib = state_bytes(optimizer) / MIB
    return result
