"""One run: deterministic, timed without evaluation, divergence recorded."""

import math

import pytest
import torch

from singd_curvlinops import KFAC
from singd_curvlinops.compare.optimizers import parse_optimizer
from singd_curvlinops.compare.trial import Precision, RunResult, run_trial
from tests.compare.conftest import short

SINGD_POINT = {"lr": 0.05, "damping": 0.05, "lr_cov": 0.05}


def metrics(result: RunResult) -> list[tuple[int, float]]:
    return [(step, metric) for step, _, metric in result.curve]


@pytest.mark.parametrize(
    ("workload", "optimizer", "params"),
    [
        ("teacher-mlp", "singd:diagonal", SINGD_POINT),
        ("sbm-gcn", "kfac", {"lr": 0.05, "damping": 0.05}),
        ("digits-cnn", "soap", {"lr": 3e-3, "weight_decay": 1e-3}),
    ],
)
def test_same_seed_same_metrics_other_seed_other_metrics(workload, optimizer, params):
    workload, spec = short(workload), parse_optimizer(optimizer)
    first = run_trial(workload, spec, params, seed=0)
    again = run_trial(workload, spec, params, seed=0)
    other = run_trial(workload, spec, params, seed=1)
    assert not first.diverged and first.error is None
    assert [step for step, _ in metrics(first)] == [0, 10, 20, 30]
    assert metrics(first) == metrics(again)
    assert first.final_metric == again.final_metric == first.curve[-1][2]
    assert metrics(first) != metrics(other)
    seconds = [s for _, s, _ in first.curve]
    assert seconds[0] == 0 and seconds == sorted(seconds) and seconds[-1] > 0
    assert first.seconds == pytest.approx(seconds[-1])
    assert first.step_peak_mib > 0 and first.state_mib > 0


def test_training_improves_the_metric():
    workload = short("teacher-mlp", steps=100, eval_every=50)
    result = run_trial(
        workload, parse_optimizer("adamw"), {"lr": 1e-2, "weight_decay": 1e-4}, 0
    )
    assert result.final_metric < 0.5 * result.curve[0][2]


def test_a_diverging_run_stops_and_has_no_final_metric():
    workload = short("teacher-mlp", steps=60, eval_every=10)
    result = run_trial(workload, parse_optimizer("sgd"), {"lr": 1e6}, 0)
    assert result.diverged and result.error is None
    assert math.isnan(result.final_metric)
    assert len(result.curve) < 7  # stopped at the first evaluation after it
    assert math.isnan(result.step_peak_mib)  # not measured


def test_an_arithmetic_error_of_the_optimizer_is_a_divergence(monkeypatch):
    spec = parse_optimizer("kfac")

    def fail(self, closure=None):
        raise ValueError("an eigendecomposition failed to converge")

    monkeypatch.setattr(KFAC, "step", fail)
    result = run_trial(short("teacher-mlp"), spec, {"lr": 0.1, "damping": 0.1}, 0)
    assert result.diverged and math.isnan(result.final_metric)
    assert result.error == "ValueError: an eigendecomposition failed to converge"
    assert len(result.curve) == 1  # the evaluation before training


def test_bf16_runs_differ_from_float32_and_record_skipped_steps():
    workload = short("teacher-mlp")
    spec = parse_optimizer("singd:diagonal")
    full = run_trial(workload, spec, SINGD_POINT, 0, Precision.FLOAT32)
    low = run_trial(workload, spec, SINGD_POINT, 0, "bf16")
    assert not low.diverged and low.skipped_steps == 0
    assert metrics(low) != metrics(full)
    assert abs(low.final_metric - full.final_metric) < 0.1 * full.final_metric
    assert Precision.BF16.factor_dtype == torch.bfloat16
    assert Precision.BF16_FP32_FACTORS.factor_dtype == torch.float32
    assert Precision.BF16_FP32_FACTORS.autocast and not Precision.FLOAT32.autocast


def test_results_round_trip_through_dictionaries():
    result = RunResult(
        [[0, 0.0, 1.0], [10, 0.5, 0.5]], 0.5, False, None, 2, 0.5, 1.0, 2.0
    )
    assert RunResult.from_dict(result.to_dict()) == result
