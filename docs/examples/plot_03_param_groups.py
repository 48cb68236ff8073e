"""# Parameter groups

Give every layer its own structures, factor-update interval and learning rate, and
see what that does to the optimizer's memory and to training.
"""

# %%
# One group per layer
# -------------------
# The convolutions have small factors (\(d_K = C_{\text{in}} k^2 + 1\),
# \(d_C = C_{\text{out}}\)), so they stay dense. The first linear layer has
# \(d_K = 513\): a block-diagonal input side with blocks of 32 stores a sixteenth of
# the dense factor, and updating it every 10 steps instead of 5 halves the cost of its
# factor updates. The classifier gets a smaller learning rate.
import matplotlib.pyplot as plt
import torch
from sklearn.datasets import load_digits
from torch import nn

from singd_curvlinops import SINGD

torch.set_num_threads(1)  # a tiny problem: one thread is fastest
digits = load_digits()
X = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
y = torch.tensor(digits.target)


def make_model() -> nn.Module:
    """Return a small CNN (same weights every time).

    Returns:
        The model.
    """
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


OPTIONS = {"lr": 0.1, "momentum": 0.9, "lr_cov": 0.01, "damping": 0.1, "T": 5}


def grouped(model: nn.Module) -> SINGD:
    """Return SINGD with one parameter group per layer.

    Args:
        model: The CNN of `make_model`.

    Returns:
        The optimizer.
    """
    conv, hidden, head = model[0], model[3], model[5]
    return SINGD(
        model,
        params=[
            {"params": conv.parameters()},
            {
                "params": hidden.parameters(),
                "structures": ("block32diagonal", "dense"),
                "T": 10,
            },
            {"params": head.parameters(), "lr": 0.05},
        ],
        **OPTIONS,
    )


def factor_numbers(optimizer: SINGD, layer: nn.Module) -> int:
    """Count the stored numbers of a layer's K, C and their momenta.

    Args:
        optimizer: A SINGD optimizer.
        layer: One of its layers.

    Returns:
        The number of stored entries.
    """
    state = optimizer.state[layer.weight]
    prefixes = ("K.", "C.", "m_K.", "m_C.")
    return sum(v.numel() for k, v in state.items() if k.startswith(prefixes))


model_dense, model_grouped = make_model(), make_model()
optimizers = {
    "one group, dense": SINGD(model_dense, **OPTIONS),
    "one group per layer": grouped(model_grouped),
}
for name, optimizer in optimizers.items():
    model = model_dense if name.startswith("one group,") else model_grouped
    counts = [factor_numbers(optimizer, model[i]) for i in (0, 3, 5)]
    print(f"{name:20s} numbers in the factors per layer: {counts}")

# %%
# Training both
# -------------
generator = torch.Generator().manual_seed(1)
batches = [torch.randint(0, len(y), (64,), generator=generator) for _ in range(150)]
losses: dict[str, list[float]] = {name: [] for name in optimizers}
for name, optimizer in optimizers.items():
    model = model_dense if name.startswith("one group,") else model_grouped
    for batch in batches:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(X[batch]), y[batch])
        loss.backward()
        optimizer.step()
        losses[name].append(loss.item())

fig, ax = plt.subplots(figsize=(6, 3.5))
for name, curve in losses.items():
    ax.plot(curve, label=name)
ax.set_xlabel("step")
ax.set_ylabel("training loss (mini-batch)")
ax.set_yscale("log")
ax.legend()
fig.tight_layout()
plt.show()

# %%
# The options of each group
# -------------------------
# Every option except `init_grad_scale` and `warn_unsupported` lives in the groups,
# where schedulers (or you) can change it during training.
for group in optimizers["one group per layer"].param_groups:
    print({key: group[key] for key in ("structures", "T", "lr", "lr_cov")})
