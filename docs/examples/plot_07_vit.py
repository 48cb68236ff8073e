"""# A Vision Transformer in one optimizer

timm's `vit_tiny_patch16_224` (random initialisation, 32x32 inputs, patches of 4x4)
trained with one `SINGD`: its `Linear` and patch-embedding `Conv2d` layers are
preconditioned, the class token, positional embedding and `LayerNorm`s go to the
AdamW fallback. A small synthetic task keeps the build of these pages short.
"""

# %%
# The model and what trains it
# ----------------------------
import matplotlib.pyplot as plt
import timm
import torch
from torch import nn

from singd_curvlinops import SINGD

torch.manual_seed(0)
model = timm.create_model(
    "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4, num_classes=4
)
optimizer = SINGD(model, lr=1e-3, T=10, structures=("diagonal", "diagonal"))
summary = optimizer.describe()
print(summary.headline())
print(f"preconditioned share: {summary.preconditioned_share:.1%}")

# %%
# Training
# --------
# Four classes of noisy images, each class a fixed random pattern; 20 steps on
# mini-batches of 8.
patterns = torch.randn(4, 3, 32, 32)
generator = torch.Generator().manual_seed(1)
losses = []
for _ in range(20):
    labels = torch.randint(0, 4, (8,), generator=generator)
    images = patterns[labels] + 0.5 * torch.randn(8, 3, 32, 32, generator=generator)
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
print(f"loss: {losses[0]:.3f} -> {losses[-1]:.3f}")

fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(losses)
ax.set_xlabel("step")
ax.set_ylabel("training loss")
ax.set_title("ViT-Tiny, one SINGD (diagonal factors, AdamW fallback)")
fig.tight_layout()
plt.show()
