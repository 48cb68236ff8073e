"""Two diagnoses on a GPU (not part of CI; see README.md).

Usage, from the repository root: `python3 .ci/gpu/drift_and_float16.py cuda
[MODEL ...]` (models of `tests/models/zoo.py`; default: four of them).

- float16 parameters under a `GradScaler`, per step: the loss, the scale,
  whether the scaled gradients are finite, how far the parameters moved, the
  skipped steps; on the GPU and the CPU, with float32 and float16 factors, and
  without a scaler. (It found that every scaled float16 step on CUDA was a zero
  step before 2026-12-04.)
- The float64 drift between the GPU and the CPU of a zoo model: its loss and
  gradients at initialisation, three AdamW steps and three SINGD steps. Models
  that compute parts in float32 whatever the parameters' dtype (Llama's rotary
  embedding) differ before any optimizer step.
"""

from __future__ import annotations

import sys
import traceback

import torch
from comparison import CPU, flat, rel
from gpu_check import (
    DEVICE,
    amp_data,
    amp_model,
    low_precision_singd,
    zoo_adamw,
    zoo_on,
    zoo_singd,
    zoo_steps,
)
from torch.nn import functional as F


def zoo_drift(name):
    out = {}
    for device in (CPU, DEVICE):
        model, loss_fn = zoo_on(device, name, torch.float64)
        loss = loss_fn(model.eval())
        loss.backward()
        grads = flat(p.grad for p in model.parameters())
        adam, _ = zoo_steps(device, name, zoo_adamw)
        singd, _ = zoo_steps(device, name, zoo_singd)
        out[device.type] = (loss.detach(), grads, adam[-1], singd)
    c, g = out["cpu"], out[DEVICE.type]
    print(
        f"DRIFT {name}: loss {rel(g[0].cpu(), c[0]):.1e}, "
        f"grads {rel(g[1], c[1]):.1e}, AdamW 3 steps {rel(g[2], c[2]):.1e}, "
        "SINGD steps "
        + ", ".join(f"{rel(a, b):.1e}" for a, b in zip(g[3], c[3], strict=True)),
        flush=True,
    )


def fp16_scaler(device, factors, scaled=True, steps=12):
    model = amp_model(device, torch.float16)
    X, y = amp_data(device, torch.float16)
    optimizer = low_precision_singd(model, factors)
    scaler = torch.amp.GradScaler(device.type) if scaled else None
    before = flat(model.parameters())
    for step in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(X).float(), y)
        (scaler.scale(loss) if scaler else loss).backward()
        finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
        gmax = max(p.grad.abs().max().item() for p in model.parameters())
        scale = scaler.get_scale() if scaler else 1.0
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        after = flat(model.parameters())
        print(
            f"FP16 {device.type} factors={factors} scaled={scaled} step {step}: "
            f"loss {loss.item():.4f} scale {scale:.0f} grads finite {bool(finite)} "
            f"max|grad| {gmax:.3g} after step max|grad| "
            f"{max(p.grad.abs().max().item() for p in model.parameters()):.3g} "
            f"moved {(after - before).abs().max().item():.2e} "
            f"skipped {optimizer.skipped_steps} "
            f"found_inf {getattr(optimizer, 'found_inf', None)}",
            flush=True,
        )
        before = after


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = False
    print(torch.__version__, flush=True)
    for args in (
        (DEVICE, torch.float32),
        (CPU, torch.float32),
        (DEVICE, None),
        (DEVICE, torch.float32, False),
    ):
        try:
            fp16_scaler(*args)
        except Exception:
            traceback.print_exc()
    for name in sys.argv[2:] or ["resnet18", "mobilenet_v3_small", "llama", "gpt2"]:
        try:
            zoo_drift(name)
        except Exception:
            traceback.print_exc()
