"""# Unsupported parameters

`SINGD` preconditions `Linear` and `Conv2d` layers. Parameters of other layers — here
a `BatchNorm2d` and a `LayerNorm` — are left out with a warning that names them. This
example shows the warning and trains those parameters with a second optimizer.
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


# %%
# The warning
# -----------
# Built with the model alone, SINGD takes the parameters of the `Conv2d` and
# `Linear` layers and warns about the others:
model = make_model()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    SINGD(model)
print(*(str(w.message) for w in caught), sep="\n")

# %%
# Two optimizers
# --------------
# Give the left-out parameters to any other optimizer — here AdamW — and call both
# in the loop. `warn_unsupported=False` silences the warning once this is taken care
# of.
model = make_model()
singd = SINGD(model, lr=0.1, lr_cov=0.01, damping=0.1, T=5, warn_unsupported=False)
preconditioned = {p for group in singd.param_groups for p in group["params"]}
others = [p for p in model.parameters() if p not in preconditioned]
adamw = torch.optim.AdamW(others, lr=1e-2)
print(f"SINGD: {len(preconditioned)} tensors, AdamW: {len(others)} tensors")

initial = [p.detach().clone() for p in others]
generator = torch.Generator().manual_seed(1)
losses = []
for _ in range(100):
    batch = torch.randint(0, len(y), (64,), generator=generator)
    singd.zero_grad()
    adamw.zero_grad()
    loss = nn.functional.cross_entropy(model(X[batch]), y[batch])
    loss.backward()
    singd.step()
    adamw.step()
    losses.append(loss.item())

moved = [(p - p0).norm().item() for p, p0 in zip(others, initial, strict=True)]
print("distance moved by the normalisation parameters:", [f"{m:.3f}" for m in moved])

fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(losses)
ax.set_xlabel("step")
ax.set_ylabel("training loss (mini-batch)")
ax.set_yscale("log")
ax.set_title("SINGD for Conv2d and Linear, AdamW for the norms")
fig.tight_layout()
plt.show()
