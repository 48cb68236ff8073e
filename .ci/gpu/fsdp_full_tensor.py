"""PyTorch's `DTensor.full_tensor()` on gloo with CUDA tensors: the reproduction.

Usage, from the repository root, on a machine with a GPU:
`torchrun --nproc_per_node 2 .ci/gpu/fsdp_full_tensor.py`. FSDP2 alone (no
SINGD) shards two linear layers on the GPU under gloo; a forward, backward and
`torch.optim.SGD` step run, then `full_tensor()` ends both processes with a
segmentation fault in `torch.distributed._functional_collectives` (PyTorch
2.11.0, 2026-12-04). See docs/pages/guide/data_parallel.md, "On GPUs".
"""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.cuda.set_device(0)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).cuda()
for layer in (model[0], model[2]):
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
print(f"rank {rank}: sharded", flush=True)
X = torch.randn(6, 8, device="cuda")
loss = model(X).square().mean()
print(f"rank {rank}: forward {loss.item():.4f}", flush=True)
loss.backward()
print(f"rank {rank}: backward", flush=True)
opt.step()
print(f"rank {rank}: FSDP2 on gloo+CUDA ran, torch {torch.__version__}", flush=True)
full = [p.full_tensor() for p in model.parameters()]
print(f"rank {rank}: full_tensor ran: {[tuple(t.shape) for t in full]}", flush=True)
dist.destroy_process_group()
sys.exit(0)
