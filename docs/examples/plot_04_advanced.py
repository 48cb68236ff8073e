"""# Advanced: AMP, accumulation, clipping, a scheduler and a checkpoint

A training loop with everything at once: mixed precision with `torch.autocast` and a
`GradScaler`, gradient accumulation over micro-batches, gradient clipping, a
learning-rate scheduler, and a checkpoint in the middle that is loaded with
`weights_only=True` into fresh objects. The resumed run ends exactly where the
uninterrupted one does.
"""

# %%
# Set-up
# ------
# On a GPU this would run float16 autocast, where the scaler matters; on the CPU
# that builds this page it runs bfloat16 autocast, with the scaler enabled all the
# same (it changes nothing in exact arithmetic, and exercises the same code path).
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from sklearn.datasets import load_digits
from torch import nn

from singd_curvlinops import SINGD

torch.set_num_threads(1)  # a tiny problem: one thread is fastest
device = "cuda" if torch.cuda.is_available() else "cpu"
amp_dtype = torch.float16 if device == "cuda" else torch.bfloat16

digits = load_digits()
X = (torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0).to(device)
y = torch.tensor(digits.target).to(device)

STEPS, MICRO_BATCHES, MICRO_BATCH_SIZE = 60, 2, 32
generator = torch.Generator().manual_seed(0)
batches = [
    torch.randint(0, len(y), (MICRO_BATCHES * MICRO_BATCH_SIZE,), generator=generator)
    for _ in range(STEPS)
]


def build() -> tuple[nn.Module, SINGD, torch.amp.GradScaler, object]:
    """Return a fresh model, optimizer, gradient scaler and scheduler.

    Returns:
        The four objects whose state a checkpoint must hold.
    """
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 10),
    ).to(device)
    optimizer = SINGD(
        model,
        lr=0.1,
        momentum=0.9,
        lr_cov=0.01,
        damping=0.1,
        T=4,
        structures=("block16diagonal", "dense"),
        preconditioner_dtype=(torch.float32, torch.float32),
    )
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
    return model, optimizer, scaler, scheduler


# %%
# One training step
# -----------------
# - **Accumulation**: each micro-batch's loss is divided by the number of
#   micro-batches (the PyTorch convention); SINGD's statistics then equal those of
#   the whole batch.
# - **Clipping under a scaler**: `unscale_` first, then tell SINGD the scale of this
#   backward pass with `set_current_grad_scale`, so that the statistics it collected
#   are unscaled too.
# - **Scheduler**: stepped after the optimizer, as for any optimizer.


def train_step(model, optimizer, scaler, scheduler, batch) -> float:
    """Run one optimizer step on a batch split into micro-batches.

    Args:
        model: The network.
        optimizer: Its SINGD optimizer.
        scaler: The gradient scaler.
        scheduler: The learning-rate scheduler.
        batch: Indices of the examples of this step.

    Returns:
        The loss of the whole batch.
    """
    optimizer.zero_grad()
    total = 0.0
    for micro in batch.split(MICRO_BATCH_SIZE):
        with torch.autocast(device_type=device, dtype=amp_dtype):
            logits = model(X[micro])
        loss = nn.functional.cross_entropy(logits.float(), y[micro]) / MICRO_BATCHES
        scaler.scale(loss).backward()
        total += loss.item()
    scaler.unscale_(optimizer)
    optimizer.set_current_grad_scale(scaler.get_scale())
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=5.0)
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    return total


# %%
# An uninterrupted run
# --------------------
model, optimizer, scaler, scheduler = build()
losses = [train_step(model, optimizer, scaler, scheduler, b) for b in batches]

# %%
# The same run, interrupted by a checkpoint
# -----------------------------------------
# Half-way, everything goes into one file: model, optimizer (factors, momenta, step
# counters, options), scaler and scheduler. `torch.load(..., weights_only=True)`
# reads it, because SINGD's state holds only tensors and plain Python values.
first = build()
for batch in batches[: STEPS // 2]:
    train_step(*first, batch)
with tempfile.TemporaryDirectory() as directory:
    path = Path(directory) / "checkpoint.pt"
    torch.save(
        {name: obj.state_dict() for name, obj in zip("mosc", first, strict=True)}, path
    )
    checkpoint = torch.load(path, weights_only=True)

resumed = build()  # a fresh process would rebuild the objects the same way
for name, obj in zip("mosc", resumed, strict=True):
    obj.load_state_dict(checkpoint[name])
resumed_losses = [train_step(*resumed, b) for b in batches[STEPS // 2 :]]

identical = all(
    torch.equal(a, b)
    for a, b in zip(model.parameters(), resumed[0].parameters(), strict=True)
)
print(f"resumed run ends with the same parameters: {identical}")
print(f"final learning rate {optimizer.param_groups[0]['lr']:.2e}, ", end="")
print(f"gradient scale {scaler.get_scale():.0f}")

# %%
# Training loss
# -------------
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(losses, label="uninterrupted")
ax.plot(range(STEPS // 2, STEPS), resumed_losses, "--", label="resumed from checkpoint")
ax.axvline(STEPS // 2, color="grey", linewidth=0.8)
ax.set_xlabel("step")
ax.set_ylabel("training loss")
ax.set_yscale("log")
ax.legend()
fig.tight_layout()
plt.show()
