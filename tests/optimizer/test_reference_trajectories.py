"""Trajectories of `SINGD` agree with the reference implementation `singd==0.0.5`.

Both optimizers train two identical copies of a small network on the same seeded
batches with the same hyperparameters; afterwards every parameter and every dense
Kronecker factor `K`, `C` must agree to 1e-10 (relative, float64) for dense and
diagonal factors and to 1e-4 (float32) for the sparse structures, which the
reference only supports in single precision.

Deliberate differences from the reference are not compared against it:

- The reference sets `alpha1 = 0` when `kfac_like=True`; ours honours `alpha1`.
  `kfac_like` is compared with `alpha1 = 0` only, and `kfac_like` with
  `alpha1 > 0` is checked against the dense formulas of `design.md` instead.
- The reference's block-diagonal `rmatmat` and `from_inner` multiply by the blocks
  `K_i` where `K_i^T` is meant, which is wrong as soon as the blocks stop being
  symmetric (after the first factor update). For `block30diagonal`, the reference
  runs with both methods patched to their transposed versions (`_fixed_block_*`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from singd.optim.optimizer import SINGD as ReferenceSINGD
from singd.structures.blockdiagonal import (
    Block30DiagonalMatrix,
    BlockDiagonalMatrixTemplate,
)
from torch import Tensor, nn

from singd_curvlinops import SINGD, get_structure

STEPS = 5
DENSE_TOL = 1e-10  # float64, dense and diagonal factors
SPARSE_TOL = 1e-4  # float32, the reference's other structures
MIN_CHANGE = 1e-2  # smallest relative change of a parameter or factor in a run
SPARSE = ("block30diagonal", "hierarchical15_15", "triltoeplitz", "triutoeplitz")
BASE = {
    "lr": 0.1,
    "momentum": 0.9,
    "damping": 1e-3,
    "alpha1": 0.5,
    "weight_decay": 0.0,
    "T": 1,
    "loss_average": "batch",
    "lr_cov": 0.1,
    "structures": ("dense", "dense"),
    "kfac_approx": "expand",
    "kfac_like": False,
    "normalize_lr_cov": False,
}


def _lr_cov_schedule(step: int) -> float:
    """A callable `lr_cov` that changes at every step."""
    return 0.02 * (1 + step)


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    """Run single-threaded: on matrices this small, thread hand-offs dominate."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------ problems
def _mlp(bias: bool) -> nn.Module:
    # dimensions above 30 so that block30diagonal and hierarchical15_15 have all
    # their parts (a full block plus a remainder, a non-empty middle diagonal)
    return nn.Sequential(
        nn.Linear(40, 36, bias=bias), nn.ReLU(), nn.Linear(36, 32, bias=bias)
    )


def _cnn(bias: bool) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(4, 8, 3, stride=2, padding=1, bias=bias),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 10, bias=bias),
    )


def _seq(bias: bool) -> nn.Module:
    return nn.Sequential(
        nn.Linear(12, 33, bias=bias), nn.ReLU(), nn.Linear(33, 10, bias=bias)
    )


PROBLEMS: dict[str, tuple[Callable[[bool], nn.Module], tuple[int, ...], int]] = {
    # name: (model factory, input shape, number of classes)
    "mlp": (_mlp, (8, 40), 32),
    "cnn": (_cnn, (6, 4, 8, 8), 10),
    "seq": (_seq, (4, 5, 12), 10),  # [batch, sequence, features]
}


def _batches(problem: str, dtype: torch.dtype) -> list[tuple[Tensor, Tensor]]:
    _, shape, classes = PROBLEMS[problem]
    generator = torch.Generator().manual_seed(1)
    target_shape = shape[:2] if problem == "seq" else shape[:1]
    return [
        (
            torch.randn(shape, generator=generator, dtype=dtype),
            torch.randint(0, classes, target_shape, generator=generator),
        )
        for _ in range(STEPS)
    ]


def _loss(output: Tensor, target: Tensor, loss_average: str | None) -> Tensor:
    """Cross entropy over all positions: mean for a loss average, else sum."""
    reduction = "sum" if loss_average is None else "mean"
    return nn.functional.cross_entropy(
        output.reshape(-1, output.shape[-1]), target.reshape(-1), reduction=reduction
    )


# ------------------------------------------------- reference block-diagonal fix
def _fixed_block_rmatmat(self: BlockDiagonalMatrixTemplate, mat: Tensor) -> Tensor:
    """`K^T @ mat` for a block-diagonal `K` (the reference computes `K @ mat`)."""
    num_blocks, last_dim = self._blocks.shape[0], self._last.shape[0]
    head, tail = mat.split([num_blocks * self.BLOCK_DIM, last_dim])
    head = head.reshape(num_blocks, self.BLOCK_DIM, mat.shape[1])
    head = torch.einsum("nji,njk->nik", self._blocks, head).flatten(0, 1)
    return torch.cat([head, self._last.T @ tail])


def _fixed_block_from_inner(
    self: BlockDiagonalMatrixTemplate, X: Tensor | None = None
) -> BlockDiagonalMatrixTemplate:
    """Block diagonal of `K^T X X^T K` (the reference computes `K X X^T K^T`)."""
    if X is None:
        blocks = torch.einsum("nji,njk->nik", self._blocks, self._blocks)
        return self.__class__(blocks, self._last.T @ self._last)
    return self.from_mat_inner(_fixed_block_rmatmat(self, X))


@pytest.fixture
def fixed_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Patch the reference's block-diagonal transposition bug for this test."""
    monkeypatch.setattr(BlockDiagonalMatrixTemplate, "rmatmat", _fixed_block_rmatmat)
    monkeypatch.setattr(
        BlockDiagonalMatrixTemplate, "from_inner", _fixed_block_from_inner
    )


def test_fixed_block_methods_transpose(fixed_reference: None) -> None:
    """The patched reference methods match dense algebra for non-symmetric blocks."""
    blocks = torch.randn(2, 30, 30, dtype=torch.float64)
    K = Block30DiagonalMatrix(blocks, torch.randn(7, 7, dtype=torch.float64))
    dense = K.to_dense()
    X = torch.randn(67, 5, dtype=torch.float64)
    torch.testing.assert_close(K.rmatmat(X), dense.T @ X)
    inner = K.from_inner(X).to_dense()
    projected = Block30DiagonalMatrix.from_dense(dense.T @ X @ X.T @ dense)
    torch.testing.assert_close(inner, projected.to_dense())
    torch.testing.assert_close(
        K.from_inner().to_dense(),
        Block30DiagonalMatrix.from_dense(dense.T @ dense).to_dense(),
    )


# ---------------------------------------------------------------- trajectories
@contextmanager
def _quiet_reference() -> Iterator[None]:
    """Silence the reference's naive-implementation and `kfac_like` warnings."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Calling naive implementation")
        warnings.filterwarnings("ignore", message=".*has kfac_like=True")
        yield


def _train(
    optimizer_cls: type, problem: str, bias: bool, dtype: torch.dtype, hyper: dict
) -> tuple[nn.Module, Any]:
    """Train a fresh seeded copy of the problem's model for `STEPS` steps."""
    torch.manual_seed(0)
    model = PROBLEMS[problem][0](bias).to(dtype)
    optimizer = optimizer_cls(model, **hyper)
    for inputs, target in _batches(problem, dtype):
        optimizer.zero_grad()
        _loss(model(inputs), target, hyper["loss_average"]).backward()
        optimizer.step()
    return model, optimizer


def _our_factor(optimizer: SINGD, layer: nn.Module, prefix: str, name: str) -> Tensor:
    """Return one of our layer's factors as a dense matrix."""
    state = optimizer.state[layer.weight]
    start = f"{prefix}."
    tensors = {k[len(start) :]: v for k, v in state.items() if k.startswith(start)}
    return get_structure(name).from_tensors(tensors).to_dense()


def _relative_error(ours: Tensor, reference: Tensor) -> float:
    return ((ours - reference).abs().max() / reference.abs().max()).item()


def _compare(problem: str, bias: bool, dtype: torch.dtype, hyper: dict) -> float:
    """Train with both optimizers; return the largest relative error.

    Parameters and the dense `K`, `C` of every layer are compared. The run must not
    be vacuous: every parameter and every factor moved well away from its start.
    """
    with _quiet_reference():
        reference_model, reference = _train(ReferenceSINGD, problem, bias, dtype, hyper)
    model, ours = _train(SINGD, problem, bias, dtype, hyper)

    torch.manual_seed(0)
    initial = PROBLEMS[problem][0](bias).to(dtype)
    errors, moved = {}, {}
    for (name, p), p_ref, p_init in zip(
        model.named_parameters(),
        reference_model.parameters(),
        initial.parameters(),
        strict=True,
    ):
        errors[name] = _relative_error(p.detach(), p_ref.detach())
        moved[name] = _relative_error(p_ref.detach(), p_init)
    for layer_name in reference.module_names.values():
        ours_layer = model.get_submodule(layer_name)
        for prefix, side, factors in (("K", 0, reference.Ks), ("C", 1, reference.Cs)):
            expected = factors[layer_name].to_dense()
            actual = _our_factor(ours, ours_layer, prefix, hyper["structures"][side])
            key = f"{layer_name}.{prefix}"
            errors[key] = _relative_error(actual, expected)
            moved[key] = _relative_error(
                expected, torch.eye(len(expected), dtype=dtype)
            )
    assert all(math.isfinite(v) for v in [*errors.values(), *moved.values()])
    worst = max(errors.values())
    print(f"\n{problem} bias={bias} {dtype}: max relative error {worst:.2e}")
    print("relative errors:", {k: f"{v:.1e}" for k, v in errors.items()})
    print("relative change:", {k: f"{v:.1e}" for k, v in moved.items()})
    assert min(moved.values()) > MIN_CHANGE, "a parameter or factor barely moved"
    return worst


def _case(problem: str, bias: bool = True, **changes: Any) -> Any:
    """One comparison: the problem, bias or not, `BASE` updated with `changes`."""
    hyper = {**BASE, **changes}
    parts = [problem, "bias" if bias else "nobias"]
    for key, value in changes.items():
        shown = ":".join(value) if key == "structures" else value
        parts.append(f"{key}={getattr(shown, '__name__', shown)}")
    return pytest.param(problem, bias, hyper, id="-".join(parts))


MIXED = (
    ("dense", "dense"),
    ("diagonal", "diagonal"),
    ("dense", "diagonal"),
    ("diagonal", "dense"),
)
DENSE_CASES = [
    # structures, per model, with and without bias
    *(
        _case(problem, bias, structures=structures)
        for problem in ("mlp", "cnn")
        for bias in (True, False)
        for structures in MIXED
    ),
    # Riemannian momentum, update interval, lr_cov variants, weight decay
    _case("mlp", alpha1=0.0),
    _case("cnn", False, alpha1=0.0, structures=("diagonal", "diagonal")),
    _case("mlp", T=3),
    _case("cnn", T=2, structures=("dense", "diagonal")),
    _case("mlp", T=2, alpha1=0.0, structures=("diagonal", "dense")),
    _case("mlp", normalize_lr_cov=True),
    _case("mlp", normalize_lr_cov=True, alpha1=0.0, lr_cov=0.5),
    _case("cnn", normalize_lr_cov=True, structures=("diagonal", "diagonal")),
    _case("mlp", lr_cov=_lr_cov_schedule),
    _case("mlp", lr_cov=_lr_cov_schedule, T=2, normalize_lr_cov=True),
    _case("mlp", weight_decay=0.01, momentum=0.0),
    # IKFAC: the reference forces alpha1 = 0, so compare only there
    _case("mlp", kfac_like=True, alpha1=0.0),
    _case("mlp", False, kfac_like=True, alpha1=0.0, normalize_lr_cov=True),
    _case("cnn", kfac_like=True, alpha1=0.0, T=2, structures=("diagonal", "dense")),
    _case("seq", kfac_approx="reduce", kfac_like=True, alpha1=0.0, T=2),
    # every loss_average (sum losses: larger gradients, smaller lr)
    _case("mlp", loss_average=None, lr=0.01),
    _case("mlp", loss_average="batch+sequence"),
    # weight sharing: expand and reduce with every loss_average
    *(
        _case(problem, bias, kfac_approx=approx, loss_average=average, lr=lr)
        for problem in ("seq", "cnn")
        for approx in ("expand", "reduce")
        for average, lr in (("batch+sequence", 0.1), ("batch", 0.1), (None, 0.01))
        for bias in ((True, False) if problem == "seq" else (True,))
    ),
    _case("seq", lr_cov=_lr_cov_schedule, normalize_lr_cov=True, T=2),
]


@pytest.mark.parametrize(("problem", "bias", "hyper"), DENSE_CASES)
def test_dense_and_diagonal_float64(problem: str, bias: bool, hyper: dict) -> None:
    error = _compare(problem, bias, torch.float64, hyper)
    assert error < DENSE_TOL, f"relative error {error:.2e} >= {DENSE_TOL}"


SPARSE_CASES = [
    case
    for name in SPARSE
    for case in (
        _case("mlp", structures=(name, name)),
        # large factor steps: block-diagonal factors become clearly non-symmetric
        _case("mlp", structures=(name, name), lr_cov=0.3),
        _case("mlp", False, structures=(name, "dense"), T=2, normalize_lr_cov=True),
        _case(
            "mlp",
            structures=("diagonal", name),
            kfac_like=True,
            alpha1=0.0,
            lr_cov=_lr_cov_schedule,
        ),
        _case(
            "mlp",
            False,
            structures=(name, name),
            alpha1=0.0,
            T=3,
            loss_average=None,
            lr=0.01,
        ),
        _case("seq", structures=(name, name), loss_average="batch+sequence"),
        _case("seq", False, structures=(name, name), kfac_approx="reduce"),
        _case("cnn", structures=(name, name)),
    )
]


@pytest.mark.parametrize(("problem", "bias", "hyper"), SPARSE_CASES)
def test_sparse_structures_float32(
    problem: str, bias: bool, hyper: dict, fixed_reference: None
) -> None:
    error = _compare(problem, bias, torch.float32, hyper)
    assert error < SPARSE_TOL, f"relative error {error:.2e} >= {SPARSE_TOL}"


# ------------------------------------------------- kfac_like with alpha1 > 0
@pytest.mark.parametrize(
    ("normalize_lr_cov", "damping"),
    # strong damping makes the momenta exceed 1, so that normalisation acts
    [(False, 1e-3), (True, 4.0)],
    ids=["plain", "normalized"],
)
def test_kfac_like_honours_alpha1(normalize_lr_cov: bool, damping: float) -> None:
    """IKFAC with `alpha1 > 0` follows the dense formulas of `design.md`.

    Checks the first layer's `K`, `C`, `m_K`, `m_C` and parameters after every
    step. (The reference would silently drop `alpha1`, so it is no oracle here.)
    """
    torch.manual_seed(0)
    dtype = torch.float64
    alpha1, lr_cov, lr, momentum = 0.5, 0.2, 0.1, 0.9
    largest_momentum = 0.0
    model = _mlp(bias=True).to(dtype)
    layer = model[0]
    captured: dict[str, Tensor] = {}

    def forward_hook(module: nn.Module, inputs: tuple, output: Tensor) -> None:
        captured["x"] = inputs[0].detach()
        output.register_hook(lambda g: captured.__setitem__("g", g.detach()))

    layer.register_forward_hook(forward_hook)
    optimizer = SINGD(
        model,
        lr=lr,
        momentum=momentum,
        damping=damping,
        alpha1=alpha1,
        T=1,
        lr_cov=lr_cov,
        kfac_like=True,
        normalize_lr_cov=normalize_lr_cov,
    )
    d_K, d_C = 41, 36
    K, C = torch.eye(d_K, dtype=dtype), torch.eye(d_C, dtype=dtype)
    m_K, m_C = torch.zeros_like(K), torch.zeros_like(C)
    buffer = None
    I_K, I_C = torch.eye(d_K, dtype=dtype), torch.eye(d_C, dtype=dtype)
    for inputs, target in _batches("mlp", dtype)[:4]:
        optimizer.zero_grad()
        _loss(model(inputs), target, "batch").backward()
        x, g = captured["x"], captured["g"]
        N = x.shape[0]
        a = torch.cat([x, torch.ones(N, 1, dtype=dtype)], dim=1)
        U_K = a.T @ a / N
        U_C = N * g.T @ g  # undo the 1/N of the mean loss
        grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1)
        params = torch.cat([layer.weight, layer.bias[:, None]], dim=1).detach()
        optimizer.step()

        # factors: IKFAC with Riemannian momentum (design.md)
        hat_K = K.T @ U_K @ K + damping * K.T @ K - I_K
        hat_C = C.T @ U_C @ C + damping * C.T @ C - I_C
        scale = 0.5 * (1 - alpha1) if normalize_lr_cov else 0.5
        m_K, m_C = alpha1 * m_K + scale * hat_K, alpha1 * m_C + scale * hat_C
        lr_K, lr_C = lr_cov, lr_cov
        largest_momentum = max(largest_momentum, m_K.abs().max(), m_C.abs().max())
        if normalize_lr_cov:
            lr_K = lr_cov / max(1.0, m_K.abs().max().item())
            lr_C = lr_cov / max(1.0, m_C.abs().max().item())
        K, C = K - lr_K * K @ m_K, C - lr_C * C @ m_C
        # parameters: natural gradient with SGD momentum
        step = C @ C.T @ grad @ K @ K.T
        buffer = step if buffer is None else momentum * buffer + step
        params = params - lr * buffer

        state = optimizer.state[layer.weight]
        for key, expected in (("K", K), ("C", C), ("m_K", m_K), ("m_C", m_C)):
            error = _relative_error(state[f"{key}.mat"], expected)
            assert error < DENSE_TOL, f"step {state['step']} {key}: {error:.2e}"
        updated = torch.cat([layer.weight, layer.bias[:, None]], dim=1).detach()
        assert _relative_error(updated, params) < DENSE_TOL
    # not vacuous: the factors moved, and the momentum term matters (without it,
    # m_K would be the last increment alone)
    assert (K - I_K).abs().max() > MIN_CHANGE
    assert (C - I_C).abs().max() > MIN_CHANGE
    assert (m_K - scale * hat_K).abs().max() > 1e-3
    assert (largest_momentum > 1.0) == normalize_lr_cov
