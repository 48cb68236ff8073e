"""Data-parallel checks with the tensors on a GPU (not part of CI; see README.md).

Usage, from the repository root:
`torchrun --nproc_per_node W .ci/gpu/dist_check.py BACKEND DEVICE [FILTER]`,
e.g. `... 2 .ci/gpu/dist_check.py gloo cuda:0` or `... 1 ... nccl cuda:0`.
Every case (`tests/distributed/harness.py`'s models, options and training loop;
FILTER keeps the cases whose name contains it) trains on this rank's share of
the global batch with the tensors on DEVICE and is compared with one process on
the whole batch on the CPU (float64, 1e-10); its optimizer state must stay on
DEVICE.
Rank 0 prints PASS/FAIL per case and a summary. FSDP2 parameters are gathered
through `all_gather_object` of their local shards, because PyTorch's own
`DTensor.full_tensor()` crashes on gloo with CUDA tensors (`fsdp_full_tensor.py`).
"""

from __future__ import annotations

import itertools
import os
import sys
import traceback
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
from comparison import rel, state_devices

sys.path.insert(0, os.getcwd())
from tests.distributed.harness import (  # noqa: E402
    DENSE,
    EKFAC_OPTIONS,
    IKFAC,
    KFAC_OPTIONS,
    SPARSE,
    Case,
    reference,
    train,
)

BACKEND, DEVICE = sys.argv[1], torch.device(sys.argv[2])


def full_params(model):
    """The full parameters on the CPU: FSDP2's row shards gathered as objects
    (DTensor.full_tensor runs an all_gather_into_tensor, not the optimizer's).
    """
    if not any(hasattr(p, "to_local") for p in model.parameters()):
        return [p.detach().cpu().clone() for p in model.parameters()]
    mine = [p.to_local().detach().cpu() for p in model.parameters()]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [torch.cat(parts) for parts in zip(*gathered, strict=True)]


CASES = []
for wrap_name in ("ddp", "fsdp"):
    # (owned factors under FSDP2 before 2026-12-05: a ValueError)
    for distribute in ("replicate", "shard", "owned", "factors"):
        for label, options in (("sparse", SPARSE), ("dense", DENSE), ("ikfac", IKFAC)):
            CASES.append(
                (
                    f"{wrap_name} {distribute} {label}",
                    Case(options=dict(options), wrap=wrap_name, distribute=distribute),
                )
            )
    # the baselines; EKFAC (replicated factor work) also on a tied embedding (both
    # before 2026-12-04 a ValueError under FSDP2, the tie also under DDP)
    baselines = [
        ("kfac shard", "kfac", KFAC_OPTIONS, "shard", "three"),
        ("kfac replicate", "kfac", KFAC_OPTIONS, "replicate", "three"),
    ]
    baselines += [
        (f"ekfac replicate model={model}", "ekfac", EKFAC_OPTIONS, "replicate", model)
        for model in ("three", "tied")
    ]  # EKFAC under "shard": owned preconditioning (before 2026-12-05 refused)
    baselines.append(("ekfac shard", "ekfac", EKFAC_OPTIONS, "shard", "three"))
    # shared eigendecompositions; owned factors (the others contribute)
    baselines.append(("ekfac owned", "ekfac", EKFAC_OPTIONS, "owned", "three"))
    for label, optimizer, options, distribute, model in baselines:
        case = Case(
            options=dict(options),
            wrap=wrap_name,
            optimizer=optimizer,
            distribute=distribute,
            model=model,
        )
        CASES.append((f"{wrap_name} {label}", case))
    CASES.append(
        (
            f"{wrap_name}_accumulate shard sparse",
            Case(
                wrap=f"{wrap_name}_accumulate" if wrap_name == "fsdp" else "accumulate"
            ),
        )
    )
    # AdamW grafting (under FSDP2 before 2026-12-04 a ValueError; on Conv1D's
    # columns beside its split bias before 2026-12-05)
    for model in ("three", "conv1d"):
        CASES.append(
            (
                f"{wrap_name} graft shard model={model}",
                Case({**SPARSE, "graft": "adamw"}, wrap_name, model=model),
            )
        )
    # "block": two layers in one FSDP2 unit; "attention": an encoder layer unit
    # and an nn.MultiheadAttention unit (both wrong under FSDP2 before 2026-12-04)
    # "tied", "embed", "conv1d": FSDP2's column shards (refused before 2026-12-04)
    models = ("norm", "two", "block", "attention", "tied", "embed", "conv1d")
    for model, distribute in itertools.product(models, ("shard", "owned")):
        CASES.append(
            (
                f"{wrap_name} {distribute} model={model}",
                Case(dict(DENSE), wrap_name, distribute, model=model),
            )
        )

if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = False
    selected = [c for c in CASES if len(sys.argv) < 4 or sys.argv[3] in c[0]]
    # one process on the whole batch, on the CPU, before the process group
    references = {
        name: reference(replace(case, device="cpu")) for name, case in selected
    }
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)
    dist.init_process_group(
        BACKEND,
        timeout=timedelta(seconds=40),
        device_id=DEVICE if BACKEND == "nccl" else None,
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    failed = 0
    for name, case in selected:
        try:
            model, _, optimizer = train(replace(case, device=str(DEVICE)))
            got, devices = full_params(model), state_devices(optimizer)
            diff = max(rel(a, b) for a, b in zip(got, references[name], strict=True))
            ok = diff < 1e-10 and devices <= {DEVICE.type}
            message = f"rel diff {diff:.1e}, state {sorted(devices)}"
        except Exception:
            ok, message = False, traceback.format_exc().strip().splitlines()[-1]
            if rank == 0 and "--trace" in sys.argv:
                traceback.print_exc()
        failed += not ok
        if rank == 0:
            print(
                f"{'PASS' if ok else 'FAIL'} {BACKEND} W={world} {DEVICE} {name}: "
                f"{message}",
                flush=True,
            )
        dist.barrier()
    if rank == 0:
        print(
            f"SUMMARY {BACKEND} W={world}: {len(selected) - failed} passed, "
            f"{failed} failed",
            flush=True,
        )
    dist.destroy_process_group()
