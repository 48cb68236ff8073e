"""# A curvlinops pipeline

SINGD inside a curvlinops workflow: its preconditioner as a curvlinops linear
operator (matrix products, scipy, estimators, spectra), the cross-check of IKFAC
against curvlinops' damped KFAC inverse, and SINGD trained on a type-2 Fisher that
curvlinops computes.
"""

# %%
# A model and a batch
# -------------------
# An MLP on scikit-learn's 8×8 digits, in float64 so that matrices can be compared
# to many digits; 1210 parameters, so that dense matrices are small.
import matplotlib.pyplot as plt
import numpy as np
import torch
from curvlinops import (
    FisherType,
    GGNLinearOperator,
    KFACInverseLinearOperator,
    KFACLinearOperator,
    hutchinson_trace,
)
from scipy.sparse.linalg import eigsh
from sklearn.datasets import load_digits
from torch import nn

from singd_curvlinops import SINGD, SINGDLinearOperator

torch.set_num_threads(1)  # a tiny problem: one thread is fastest
digits = load_digits()
X_all = torch.tensor(digits.data, dtype=torch.float64) / 16.0
y_all = torch.tensor(digits.target)
X, y = X_all[:256], y_all[:256]  # the batch for the curvature matrices
loss_func = nn.CrossEntropyLoss()


def make_model() -> nn.Module:
    """Return a 64-16-10 MLP in float64 (same weights every time).

    Returns:
        The model.
    """
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)).double()


def dense(operator) -> np.ndarray:
    """Return a linear operator's matrix, through its scipy interface.

    Args:
        operator: A curvlinops (or SINGD) linear operator.

    Returns:
        The dense matrix.
    """
    return operator.to_scipy() @ np.eye(operator.shape[1])


# %%
# The preconditioner as a linear operator
# ---------------------------------------
# After a few SINGD steps, `SINGDLinearOperator` freezes the current preconditioner
# \(P = C C^\top \otimes K K^\top\) per layer as a curvlinops `PyTorchLinearOperator`:
# it multiplies tensor lists in parameter order, converts to scipy, and works with
# curvlinops' estimators. `P.inverse()` is the curvature SINGD implies.
model = make_model()
optimizer = SINGD(model, lr=0.1, lr_cov=0.05, damping=0.1, T=1)
for _ in range(20):
    optimizer.zero_grad()
    loss_func(model(X), y).backward()
    optimizer.step()

P = SINGDLinearOperator(optimizer)
gradient = [p.grad for p in P.params]  # the operator's order (the groups')
direction = P @ gradient  # SINGD's direction, before momentum and learning rate
print("shapes:", [tuple(d.shape) for d in direction])
print(f"trace of P: exact {np.trace(dense(P)):.2f}, ", end="")
print(f"Hutchinson (100 samples) {hutchinson_trace(P, num_matvecs=100):.2f}")

# %%
# Spectra: SINGD's implied curvature next to curvlinops' matrices
# ---------------------------------------------------------------
# The largest eigenvalues of the generalized Gauss-Newton matrix, of its KFAC
# approximation, and of SINGD's implied curvature \(P^{-1}\) (applied through
# structured solves), each by scipy's Lanczos solver on the scipy operator.
# SINGD's factors start at the identity and move at the pace of `lr_cov`: after 20
# steps its implied curvature is still much flatter than the GGN.
# (curvlinops' operators check by default that repeated passes give the same loss;
# this model is deterministic, so `check_deterministic=False` saves those passes.)
params = list(model.parameters())
operators = {
    "GGN": GGNLinearOperator(
        model, loss_func, params, [(X, y)], check_deterministic=False
    ),
    "KFAC (type-2)": KFACLinearOperator(
        model,
        loss_func,
        params,
        [(X, y)],
        fisher_type=FisherType.TYPE2,
        separate_weight_and_bias=False,
        check_deterministic=False,
    ),
    "SINGD's P⁻¹": P.inverse(),
}
fig, ax = plt.subplots(figsize=(6, 3.5))
for name, operator in operators.items():
    top = eigsh(operator.to_scipy(), k=20, which="LA", return_eigenvectors=False)
    ax.plot(np.sort(top)[::-1], "o-", markersize=3, label=name)
ax.set_xlabel("eigenvalue index")
ax.set_ylabel("eigenvalue")
ax.set_yscale("log")
ax.legend()
fig.tight_layout()
plt.show()

# %%
# The cross-check: IKFAC reaches curvlinops' damped KFAC inverse
# ---------------------------------------------------------------
# IKFAC (`kfac_like=True`) with dense factors, no momentum and `lr=0`, iterated on a
# fixed batch, converges to \(K K^\top = (U_K + \lambda I)^{-1}\) and
# \(C C^\top = (U_C + \lambda I)^{-1}\): its preconditioner is then curvlinops'
# `KFACInverseLinearOperator` of the empirical Fisher's KFAC with damping
# \((\lambda, \lambda)\). This is the central test of the package. (Near the fixed
# point the error shrinks by the factor \(1 - \beta_1\) per step; from the identity,
# the iteration converges if \(\beta_1\) is below about \(4 / \lambda_{\max}\) of
# \(U_K + \lambda I\), which is near 12 for these inputs.)
damping = 0.5
model = make_model()
ikfac = SINGD(
    model,
    kfac_like=True,
    alpha1=0.0,
    lr=0.0,
    momentum=0.0,
    T=1,
    lr_cov=0.2,
    damping=damping,
)
for _ in range(200):
    ikfac.zero_grad()
    loss_func(model(X), y).backward()
    ikfac.step()
kfac = KFACLinearOperator(
    model,
    loss_func,
    list(model.parameters()),
    [(X, y)],
    fisher_type=FisherType.EMPIRICAL,
    separate_weight_and_bias=False,
    check_deterministic=False,
)
expected = dense(KFACInverseLinearOperator(kfac, damping=(damping, damping)))
actual = dense(SINGDLinearOperator(ikfac))
error = np.abs(actual - expected).max() / np.abs(expected).max()
print(f"relative difference from curvlinops' damped KFAC inverse: {error:.1e}")

# %%
# Training on curvlinops' type-2 Fisher
# -------------------------------------
# By default SINGD's statistics are the empirical Fisher of the training pass.
# `set_curvature` hands the next factor update the Kronecker factors of any
# `KFACLinearOperator` instead — here the type-2 Fisher (the GGN's KFAC) of each
# mini-batch, computed by curvlinops before the training pass.
generator = torch.Generator().manual_seed(1)
batches = [torch.randint(0, len(y_all), (128,), generator=generator) for _ in range(60)]
curves = {}
for name in ("empirical Fisher (default)", "type-2 Fisher via set_curvature"):
    model = make_model()
    optimizer = SINGD(model, lr=0.1, lr_cov=0.05, damping=0.1, T=1)
    curves[name] = []
    for batch in batches:
        if name.startswith("type-2"):
            optimizer.set_curvature(
                KFACLinearOperator(
                    model,
                    loss_func,
                    list(model.parameters()),
                    [(X_all[batch], y_all[batch])],
                    fisher_type=FisherType.TYPE2,
                    separate_weight_and_bias=False,
                    check_deterministic=False,
                )
            )
        optimizer.zero_grad()
        loss = loss_func(model(X_all[batch]), y_all[batch])
        loss.backward()
        optimizer.step()
        curves[name].append(loss.item())

fig, ax = plt.subplots(figsize=(6, 3.5))
for name, curve in curves.items():
    ax.plot(curve, label=name)
ax.set_xlabel("step")
ax.set_ylabel("training loss (mini-batch)")
ax.set_yscale("log")
ax.legend()
fig.tight_layout()
plt.show()
