"""The help texts of `singd-curvlinops demo` and `bench` (`cli`)."""

DEMO_DESCRIPTION = """\
Train the same small CNN on scikit-learn's digits (bundled, no download) with
each optimizer: same initial weights, same mini-batch order. Prints a table and
writes a PNG plot of the loss curves. Needs the examples extra:
pip install "singd-curvlinops[examples]".
"""

DEMO_EPILOG = """\
optimizers (--optimizers, comma-separated):
  singd:STRUCTURE   SINGD, both Kronecker factors of every layer in STRUCTURE, e.g.
                    dense, diagonal, block30diagonal, hierarchical15_15,
                    triltoeplitz (plain `singd` means dense)
  ikfac[:STRUCTURE] IKFAC: SINGD with kfac_like=True (default structure dense)
  kfac              the KFAC baseline (dense factors, damped inverses every T steps)
  adamw, sgd        torch.optim.AdamW and torch.optim.SGD with momentum

table columns:
  final train loss  mean cross-entropy on the whole training set after training
  test accuracy     on the 450 held-out digits after the last epoch
  ms/step           wall-clock time of zero_grad + forward + backward + step,
                    averaged over all steps of the run (runs one after the other:
                    use `singd-curvlinops bench` for interleaved timings)
  state MiB         tensors in the optimizer's state after training

example:
  singd-curvlinops demo --epochs 3 --optimizers singd:diagonal,ikfac,adamw
"""

BENCH_DESCRIPTION = """\
Time and memory per training step of SINGD per structure, the reference singd,
KFAC, AdamW and SGD, interleaved in one process (float32, CPU). Prints one
Markdown table per model.
"""

BENCH_EPILOG = """\
rows per model: SINGD per structure and T, the reference singd (when installed
and it has the structure), KFAC per T, AdamW, SGD. Every configuration trains its
own copy of one seeded model on a fixed mini-batch; all are timed in blocks of
--steps-per-block steps, round-robin over --rounds rounds (median reported).

columns:
  ms/step        median time of zero_grad + forward + backward + step
  × AdamW        ms/step divided by AdamW's on the same model
  ours / ref     ms/step of SINGD divided by the reference's (same structure, T)
  step peak MiB  the most memory one step allocates and holds at once, from
                 torch.profiler's allocation events (largest over T steps, so a
                 factor update is included); parameters, batch and state excluded
  state MiB      tensors in the optimizer's state (and the reference's factors)
  final loss     on the fixed batch after all steps

models: mlp 784-512-512-10 (batch 128); cnn three stride-2 3x3 convolutions on
3x32x32 images and a linear layer (batch 64); seq a per-token MLP 256-256-256-10
on [16, 64, 256] tokens (loss_average="batch+sequence").

example:
  singd-curvlinops bench --models mlp --structures diagonal --T 10 --rounds 3

distributed (--distributed, started by torchrun; gloo on CPU):
  torchrun --nproc_per_node 2 -m singd_curvlinops bench --distributed
  times SINGD with distribute="replicate", "shard", Shard(share="factors") and
  Shard(factors="owned") on the processes (DDP, each on its share of the batch,
  one torch thread each unless --threads), default structure dense; prints one
  table with the slowest process's ms/step (median and spread over the rounds),
  the ratio to replicate, the factor state of the process that holds the most,
  and the bytes the collectives move; with --fsdp the model is sharded by FSDP2,
  with --hsdp R by HSDP (R replicas, each sharded over its processes);
  with --optimizer ekfac, EKFAC (structures auto) under replicate, shard and
  Shard(factors="owned").
"""
