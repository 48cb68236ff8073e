import pytest
import torch

from singd_curvlinops.demo import run_demo
from singd_curvlinops.demo.optimizers import OptimizerSpec, parse_optimizer
from singd_curvlinops.demo.report import _moving_average, results_table
from singd_curvlinops.demo.training import (
    TEST_EXAMPLES,
    TRAIN_EXAMPLES,
    RunResult,
    load_digits_data,
    make_model,
    train,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def digits():
    return load_digits_data()


def test_digits_split(digits):
    assert digits.X_train.shape == (TRAIN_EXAMPLES, 1, 8, 8)
    assert digits.X_test.shape == (TEST_EXAMPLES, 1, 8, 8)
    assert digits.X_train.dtype == torch.float32
    assert 0 <= digits.X_train.min() and digits.X_train.max() <= 1
    counts = torch.bincount(digits.y_test, minlength=10)
    assert counts.min() >= 43 and counts.max() <= 46  # stratified: 10% per digit
    assert len(load_digits_data(train_size=100).y_train) == 100
    assert make_model(0)(digits.X_test[:5]).shape == (5, 10)


def test_every_optimizer_starts_from_the_same_weights_and_batches(digits):
    first_losses = []
    for name in ("singd:diagonal", "kfac", "adamw"):
        result = train(
            parse_optimizer(name),
            digits,
            epochs=1,
            batch_size=64,
            seed=3,
            progress=False,
        )
        assert len(result.losses) == TRAIN_EXAMPLES // 64
        first_losses.append(result.losses[0])
    assert first_losses[0] == first_losses[1] == first_losses[2]
    again = train(
        parse_optimizer("singd:diagonal"),
        digits,
        epochs=1,
        batch_size=64,
        seed=3,
        progress=False,
    )
    assert again.losses[0] == first_losses[0]


@pytest.mark.parametrize("name", ["singd:dense", "singd:diagonal", "ikfac", "kfac"])
def test_default_settings_reach_ninety_percent(name, digits):
    result = train(
        parse_optimizer(name), digits, epochs=10, batch_size=64, seed=0, progress=False
    )
    assert result.test_accuracy > 0.9, result.accuracies
    assert result.final_train_loss < result.losses[0] / 10
    assert len(result.accuracies) == 11
    assert result.ms_per_step > 0 and result.state_mib > 0


def test_bad_epochs_and_batch_sizes_are_rejected(digits):
    small = load_digits_data(train_size=10)
    with pytest.raises(ValueError, match=r"batch_size must be in \[1, 10\]"):
        train(OptimizerSpec("sgd"), small, epochs=1, batch_size=11, seed=0)
    with pytest.raises(ValueError, match="epochs must be >= 1, got 0"):
        train(OptimizerSpec("sgd"), small, epochs=0, batch_size=5, seed=0)
    for seed in (-1, 2**64, 1.5, True):  # torch.manual_seed's range is 64 bits
        with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*64"):
            train(OptimizerSpec("sgd"), small, epochs=1, batch_size=5, seed=seed)


def test_run_demo_returns_one_result_per_optimizer():
    specs = [OptimizerSpec("adamw"), OptimizerSpec("singd", "triltoeplitz")]
    results = run_demo(specs, epochs=2, batch_size=16, train_size=48, progress=False)
    assert [r.label for r in results] == ["AdamW", "SINGD (triltoeplitz)"]
    assert all(len(r.losses) == 2 * 3 and len(r.accuracies) == 3 for r in results)


def test_results_table_and_moving_average():
    result = RunResult("SGD", [1.0], [0.1, 0.9731], 0.01234, 1.5, 0.25)
    assert results_table([result]).splitlines()[2] == (
        "| SGD | 0.0123 | 97.3% | 1.50 | 0.2500 |"
    )
    assert _moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert _moving_average([2.0], 10) == [2.0]
