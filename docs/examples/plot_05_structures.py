r"""# Structures visualised

What each structure looks like: the sparsity pattern of a random member of every
structure family, the pattern of the preconditioner factor \(K K^\top\) it
produces, and how many numbers each one stores.
"""

# %%
# A random member of each structure
# ---------------------------------
# `get_structure(name)` returns the class behind a structure name. Its projection
# `from_dense` maps a symmetric matrix onto the structure, so projecting a random
# symmetric matrix gives a random member. (Entries of a triangular part whose mirror
# image lies outside the structure are *folded*: they store \(S_{ij} + S_{ji}\).)
import matplotlib.pyplot as plt
import torch

from singd_curvlinops.structures import get_structure

NAMES = [
    "dense",
    "diagonal",
    "block4diagonal",
    "hierarchical3_2",
    "triltoeplitz",
    "triutoeplitz",
    "trilbottomrightdiag",
    "triltopleftdiag",
    "triubottomrightdiag",
    "triutopleftdiag",
]
DIM = 12

torch.manual_seed(0)
S = torch.rand(DIM, DIM, dtype=torch.float64) + 0.5  # positive: zeros stand out
S = (S + S.T) / 2
members = {name: get_structure(name).from_dense(S) for name in NAMES}


def show(matrices: dict[str, torch.Tensor], title: str) -> None:
    """Draw one dense matrix per structure name, zeros in white.

    Args:
        matrices: Map from structure name to a `[DIM, DIM]` tensor.
        title: Title of the figure.
    """
    fig, axes = plt.subplots(2, 5, figsize=(11, 5.6))
    for ax, (name, mat) in zip(axes.flat, matrices.items(), strict=True):
        pattern = mat.abs()
        pattern[pattern == 0] = float("nan")  # white
        ax.imshow(pattern, cmap="viridis")
        ax.set_title(name, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(title)
    fig.tight_layout()


show({name: K.to_dense() for name, K in members.items()}, "K")
plt.show()

# %%
# The preconditioner factor \(K K^\top\)
# -----------------------------------------
# SINGD preconditions with \(C C^\top \otimes K K^\top\). For dense, diagonal and
# block-diagonal structures \(K K^\top\) has the structure of \(K\); for the
# others it fills in, partly (a diagonal plus one *row* gives a diagonal plus a
# cross, a hierarchical matrix an arrowhead) or entirely (triangular Toeplitz, a
# diagonal plus one *column*). The optimizer never forms it: it applies
# \(K (K^\top V)\) with the structure's products.
identity = torch.eye(DIM, dtype=torch.float64)
show({name: K @ K.rmatmat(identity) for name, K in members.items()}, "K Kᵀ")
plt.show()

# %%
# Memory
# ------
# `numel()` counts the stored entries. For the input-side factor of a layer with
# 1024 inputs and a bias (\(d = 1025\)), with the block sizes one would use at
# that width:
for name in [*NAMES[:2], "block30diagonal", "hierarchical15_15", *NAMES[4:]]:
    K = get_structure(name).eye(1025)
    print(f"{name:20s} {K.numel():>9,d} numbers ({K.numel() / 1025**2:.2%} of dense)")
