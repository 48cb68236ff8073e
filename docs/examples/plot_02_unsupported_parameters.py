"""# Parameters of other layers

`SINGD` preconditions `Linear`, `Conv2d`, `Embedding`, attention and a few more layer
types. Every other trainable parameter — here those of a `BatchNorm2d` and a
`LayerNorm` — is trained by the *fallback rule*, AdamW by default, in the same
optimizer. This example shows what goes where, and the old way: `fallback=None`
leaves them out with a warning, for a second optimizer.
"""

# %%
# A model with normalisation layers
# ---------------------------------
import warnings

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
    """Return a CNN with a batch norm and a layer norm (same weights every time).

    Returns:
        The model.
    """
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 32),
        nn.LayerNorm(32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )


def train(model: nn.Module, optimizers: list, steps: int = 60) -> list[float]:
    """Train on mini-batches of 64 digits; return the losses.

    Args:
        model: The network.
        optimizers: Its optimizers (all are stepped).
        steps: Number of steps.

    Returns:
        The loss of every step.
    """
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        index = torch.randint(0, len(y), (64,), generator=generator)
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(X[index]), y[index])
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        losses.append(loss.item())
    return losses


# %%
# One optimizer
# -------------
# Built with the model alone, SINGD preconditions the `Conv2d` and `Linear` layers and
# trains the norms with AdamW; `describe()` shows who trains what.
model = make_model()
singd = SINGD(model, lr=0.1, lr_cov=0.01, damping=0.1, T=5, fallback_lr_ratio=0.1)
print(singd.describe())
one = train(model, [singd])

# %%
# Two optimizers
# --------------
# With `fallback=None` SINGD leaves the other parameters out and warns by name; give
# them to any other optimizer and call both in the loop.
model = make_model()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    singd = SINGD(model, lr=0.1, lr_cov=0.01, damping=0.1, T=5, fallback=None)
print(*(str(w.message) for w in caught), sep="\n")
preconditioned = {p for group in singd.param_groups for p in group["params"]}
others = [p for p in model.parameters() if p not in preconditioned]
adamw = torch.optim.AdamW(others, lr=1e-2)
two = train(model, [singd, adamw])

fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(one, label="SINGD with the AdamW fallback")
ax.plot(two, label="SINGD + a separate AdamW", linestyle="--")
ax.set_xlabel("step")
ax.set_ylabel("training loss")
ax.legend()
fig.tight_layout()
plt.show()
