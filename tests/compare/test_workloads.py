"""Every workload loads its data without network, is seeded, and trains."""

import math
import socket
import warnings

import pytest
import torch

from singd_curvlinops import SINGD
from singd_curvlinops.compare import data
from singd_curvlinops.compare.workloads import WORKLOADS


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails."""

    def refuse(*args, **kwargs):
        raise OSError("network access in a test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_the_five_workloads_are_registered():
    assert list(WORKLOADS) == [
        "digits-cnn",
        "digits-vit",
        "stdlib-lm",
        "sbm-gcn",
        "teacher-mlp",
    ]
    for workload in WORKLOADS.values():
        assert workload.steps % workload.eval_every == 0
        assert workload.bf16_tolerance > 0


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_data_loads_without_network_and_the_problem_trains(name, no_network):
    workload = WORKLOADS[name]
    problem = workload.build(0)
    with torch.no_grad():
        metric = problem.evaluate()
    assert math.isfinite(metric)
    assert not workload.reached(metric)  # an untrained model is not on target
    loss = problem.loss()
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in problem.model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_every_parameter_is_in_a_layer_that_singd_preconditions(name):
    model = WORKLOADS[name].build(0).model
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # SINGD warns about left-out parameters
        optimizer = SINGD(model)
    preconditioned = {p for group in optimizer.param_groups for p in group["params"]}
    assert preconditioned == set(model.parameters())


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_a_seed_fixes_weights_and_batches(name):
    workload = WORKLOADS[name]
    first, again, other = workload.build(3), workload.build(3), workload.build(4)
    for a, b in zip(first.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(first.loss(), again.loss())
    assert torch.equal(first.loss(), again.loss())  # the second batch too
    assert not all(
        torch.equal(a, b)
        for a, b in zip(first.model.parameters(), other.model.parameters(), strict=True)
    )


def test_stdlib_corpus_is_split_per_file_and_digested(tmp_path):
    corpus = data.stdlib_corpus()
    assert corpus.train.dtype == torch.int64
    assert 0 <= int(corpus.train.min()) and int(corpus.train.max()) < data.VOCABULARY
    assert 0.08 < len(corpus.val) / (len(corpus.train) + len(corpus.val)) < 0.12
    assert len(corpus.sha256) == 64 and corpus == data.stdlib_corpus()
    assert data.encode("def f():\n\treturn 1").tolist()[:3] == [69, 70, 71]
    assert data.encode("\t").tolist() == [data.VOCABULARY - 1]
    (tmp_path / data.STDLIB_MODULES[0]).write_text("x = 1\n", encoding="utf-8")
    with pytest.raises(FileNotFoundError, match=data.STDLIB_MODULES[1]):
        data.stdlib_corpus(tmp_path)


def test_sbm_graph_is_undirected_simple_and_split():
    graph = data.sbm_graph()
    source, target = graph.edge_index
    n = len(graph.y)
    assert n == 600 and graph.x.shape == (600, 16)
    assert not (source == target).any()  # no self-loops
    edges = set(zip(source.tolist(), target.tolist(), strict=True))
    assert all((j, i) in edges for i, j in edges)  # both directions
    within = (graph.y[source] == graph.y[target]).float().mean()
    assert within > 0.4  # 4 blocks, p_in = 5 p_out: mostly within blocks
    assert not (graph.train_mask & graph.val_mask).any()
    assert int(graph.train_mask.sum()) == 60 and int(graph.val_mask.sum()) == 180
    assert torch.equal(graph.edge_index, data.sbm_graph.__wrapped__().edge_index)


def test_teacher_is_fixed_and_validation_targets_vary():
    X, y = data.teacher_validation()
    assert X.shape == (2048, 32) and y.shape == (2048, 8)
    assert torch.equal(data.teacher()(X[:4]), y[:4])
    assert y.var() > 0.05  # not a constant function
