"""Chosen trials, performance profiles and the bfloat16 judgement on made-up runs."""

import math

import pytest

from singd_curvlinops.compare.cells import Cell
from singd_curvlinops.compare.optimizers import parse_optimizer
from singd_curvlinops.compare.study import Run
from singd_curvlinops.compare.summary import (
    bf16_rows,
    performance_profiles,
    rows_of,
    upper_median,
)
from singd_curvlinops.compare.trial import Precision, RunResult, seconds_to_target
from singd_curvlinops.compare.workloads import WORKLOADS

INF = math.inf


def run(workload, optimizer, index, seed, seconds, final, step=10, **kwargs):
    """A made-up run of a workload that reaches its target after `seconds`, at
    `step`."""
    workload = WORKLOADS[workload]
    start = 0.0 if workload.higher_is_better else 10.0
    curve = [[0, 0.0, start], [100, 50.0, start]]
    if math.isfinite(seconds):
        curve.insert(1, [step, seconds, workload.target])
    precision = kwargs.pop("precision", Precision.FLOAT32)
    result = RunResult(curve, final, **kwargs)
    cell = Cell(workload, parse_optimizer(optimizer), precision)
    return Run(cell, index, seed, {"lr": 0.1 * (index + 1)}, result, {})


def test_upper_median_is_the_larger_middle_value():
    assert upper_median([3.0, 1.0, 2.0]) == 2.0
    assert upper_median([1.0, 2.0]) == 2.0
    assert upper_median([1.0, INF]) == INF
    assert (
        upper_median([0.9, math.nan, 0.8], key=lambda v: -v if v == v else INF) == 0.8
    )


def test_seconds_to_target_is_the_first_evaluation_on_target():
    result = run("digits-cnn", "sgd", 0, 0, 4.0, 0.98).result
    assert seconds_to_target(WORKLOADS["digits-cnn"], result) == (10.0, 4.0)
    missed = run("digits-cnn", "sgd", 0, 0, INF, 0.5).result
    assert seconds_to_target(WORKLOADS["digits-cnn"], missed) == (INF, INF)


def test_the_chosen_point_has_the_smallest_median_time_over_its_seeds():
    runs = [
        run("digits-cnn", "sgd", 0, 0, 1.0, 0.98),
        run("digits-cnn", "sgd", 0, 1, INF, 0.9),  # misses in one of two seeds
        run("digits-cnn", "sgd", 1, 0, 2.0, 0.975),
        run("digits-cnn", "sgd", 1, 1, 3.0, 0.972),
        run("digits-cnn", "sgd", 2, 0, 0.5, 0.99),  # seed 1 missing: not finished
    ]
    (row,) = rows_of(runs, seeds=2)
    assert [point.index for point in row.points] == [0, 1]
    assert row.chosen.index == 1 and row.seconds == 3.0
    assert row.chosen.final_metric == 0.972  # the worse of the two seeds
    assert row.best_final == 0.972 and row.solved == 1
    assert rows_of(runs, seeds=3)[0].chosen is None


def test_without_a_point_on_target_the_best_final_metric_is_chosen():
    runs = [
        run("teacher-mlp", "adamw", 0, 0, INF, 0.3),
        run("teacher-mlp", "adamw", 1, 0, INF, 0.2),
        run("teacher-mlp", "adamw", 2, 0, INF, math.nan, diverged=True),
    ]
    (row,) = rows_of(runs, seeds=1)
    assert row.chosen.index == 1 and row.seconds == INF and row.best_final == 0.2


def test_time_decides_before_steps_and_a_diverged_run_is_the_worst():
    runs = [
        run("digits-cnn", "sgd", 0, 0, 3.0, 0.98, step=2),
        run("digits-cnn", "sgd", 1, 0, 2.0, 0.97, step=5),  # fewer seconds
    ]
    (row,) = rows_of(runs, seeds=1)
    assert row.chosen.index == 1 and (row.chosen.steps, row.seconds) == (5, 2.0)
    runs = [  # a NaN (listed first) is worse than any metric
        run("teacher-mlp", "adamw", 0, 0, INF, math.nan, diverged=True),
        run("teacher-mlp", "adamw", 1, 0, INF, 0.3),
    ]
    (row,) = rows_of(runs, seeds=1)
    assert row.chosen.index == 1 and row.best_final == 0.3


def test_performance_profile_and_its_integral():
    times = {"sgd": (1.0, 2.0, INF), "adamw": (2.0, 1.0, INF), "kfac": (INF, 8.0, INF)}
    workloads = ("digits-cnn", "sbm-gcn", "teacher-mlp")  # nobody solves the last
    runs = [
        run(workload, optimizer, 0, 0, seconds, 0.0)
        for optimizer, row in times.items()
        for workload, seconds in zip(workloads, row, strict=True)
    ]
    profiles = {p.label: p for p in performance_profiles(rows_of(runs, seeds=1))}
    assert profiles["SGD"].ratios == {
        "digits-cnn": 1.0,
        "sbm-gcn": 2.0,
        "teacher-mlp": INF,
    }
    # (4 - 1)/3 and (4 - 2)/3 over three workloads
    assert profiles["SGD"].score == pytest.approx((1 + 2 / 3) / 3)
    assert profiles["AdamW"].score == pytest.approx(profiles["SGD"].score)
    assert profiles["KFAC"].ratios["sbm-gcn"] == 8.0 and profiles["KFAC"].score == 0
    assert profiles["SGD"].fraction(1.0) == pytest.approx(1 / 3)
    assert profiles["SGD"].fraction(2.0) == pytest.approx(2 / 3)


def test_an_optimizer_missing_a_workload_is_not_profiled():
    runs = [
        run("digits-cnn", "sgd", 0, 0, 1.0, 0.98),
        run("sbm-gcn", "sgd", 0, 0, 1.0, 0.98),
        run("digits-cnn", "adamw", 0, 0, 1.0, 0.98),
    ]
    assert [p.label for p in performance_profiles(rows_of(runs, seeds=1))] == ["SGD"]


def test_bf16_runs_are_judged_against_their_float32_partner():
    bf16 = {"precision": Precision.BF16}
    runs = [
        run("digits-cnn", "kfac", 0, 0, 1.0, 0.97),
        run("digits-cnn", "kfac", 1, 0, 1.0, 0.97),
        run("digits-cnn", "kfac", 2, 0, 1.0, 0.97),
        run("digits-cnn", "kfac", 3, 0, INF, math.nan, diverged=True),
        run("digits-cnn", "kfac", 0, 0, 1.0, 0.96, **bf16),  # within 0.02: ok
        run("digits-cnn", "kfac", 1, 0, INF, 0.90, **bf16),  # degraded
        run("digits-cnn", "kfac", 2, 0, INF, math.nan, diverged=True, **bf16),
        run("digits-cnn", "kfac", 3, 0, INF, math.nan, diverged=True, **bf16),
        run("digits-cnn", "kfac", 4, 0, INF, 0.5, **bf16),  # no partner
    ]
    (row,) = bf16_rows(runs)
    assert (row.label, row.precision) == ("KFAC", Precision.BF16)
    assert (row.pairs, row.ok, row.degraded, row.diverged) == (4, 1, 1, 1)
    assert row.float32_diverged == 1
    assert row.median_change == pytest.approx(0.07)  # of 0.01, 0.07 and ∞
