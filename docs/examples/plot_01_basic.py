"""# Basic usage

Train a small convolutional network on scikit-learn's 8×8 digits with `SINGD`, as
one would with any `torch.optim` optimizer, and compare it with its baselines IKFAC
and KFAC and with SGD with momentum.
"""

# %%
# Data and model
# --------------
# The digits ship with scikit-learn (nothing is downloaded): 1797 grey-scale images
# of 8×8 pixels, ten classes. We hold out a quarter of them for testing.
import matplotlib.pyplot as plt
import torch
from sklearn.datasets import load_digits
from torch import nn

from singd_curvlinops import KFAC, SINGD

torch.set_num_threads(1)  # a tiny problem: one thread is fastest
torch.manual_seed(0)
digits = load_digits()
X = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
y = torch.tensor(digits.target)
permutation = torch.randperm(len(y))
train, test = permutation[:1350], permutation[1350:]


def make_model() -> nn.Module:
    """Return a fresh CNN with the same initial weights every time.

    Returns:
        Two convolutions and a linear classifier.
    """
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 10),
    )


# %%
# The training loop
# -----------------
# SINGD needs the model (it installs a forward hook on every `Linear` and `Conv2d`
# layer) and otherwise takes the arguments of the reference implementation. The loop
# is the usual `zero_grad`, forward, `backward`, `step`. `T=5` updates the Kronecker
# factors on every fifth step; in between, the step only applies the preconditioner.
# The hyperparameters were picked by a small search on this problem; they are not
# recommendations.
# IKFAC is `SINGD(..., kfac_like=True)`, and `KFAC` the KFAC baseline on the same
# statistics; they take the same training loop.


def train_and_evaluate(make_optimizer, epochs: int = 4) -> tuple[list[float], float]:
    """Train a fresh model; return the loss of every step and the test accuracy.

    Args:
        make_optimizer: Function from the model to its optimizer.
        epochs: Passes over the training set.

    Returns:
        The training losses and the final test accuracy.
    """
    model = make_model()
    optimizer = make_optimizer(model)
    generator = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(epochs):
        for batch in train[torch.randperm(len(train), generator=generator)].split(64):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(X[batch]), y[batch])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    with torch.no_grad():
        accuracy = (model(X[test]).argmax(1) == y[test]).float().mean().item()
    return losses, accuracy


SINGD_OPTIONS = {"lr": 0.1, "momentum": 0.9, "lr_cov": 0.01, "damping": 0.1, "T": 5}
optimizers = {
    "SINGD (dense K, C)": lambda model: SINGD(model, **SINGD_OPTIONS),
    "SINGD (block-diagonal K, diagonal C)": lambda model: SINGD(
        model, **SINGD_OPTIONS, structures=("block16diagonal", "diagonal")
    ),
    "IKFAC (dense)": lambda model: SINGD(
        model, **SINGD_OPTIONS, kfac_like=True, alpha1=0.0
    ),
    # KFAC inverts its damped factors exactly; it needs more damping here
    "KFAC": lambda model: KFAC(model, lr=0.1, momentum=0.9, damping=1.0, T=5),
    "SGD": lambda model: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
}
results = {name: train_and_evaluate(make) for name, make in optimizers.items()}
for name, (_, accuracy) in results.items():
    print(f"{name:40s} test accuracy {accuracy:.3f}")

# %%
# Training curves
# ---------------
fig, ax = plt.subplots(figsize=(6, 3.5))
for name, (losses, _) in results.items():
    ax.plot(losses, label=name)
ax.set_xlabel("step")
ax.set_ylabel("training loss (mini-batch)")
ax.set_yscale("log")
ax.legend()
fig.tight_layout()
plt.show()
