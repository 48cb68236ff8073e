"""Checks of the optimizers on a GPU against the CPU (not part of CI; see README.md).

Usage, from the repository root: `python3 .ci/gpu/gpu_check.py [cuda] [--time]`.
Each check prints one line, `PASS`/`FAIL name: figures`; an exception in one
check is printed and the others still run. float64 trajectories on the GPU
equal the CPU's to 1e-10 (every structure, IKFAC, KFAC, EKFAC, grafting,
`set_curvature`, `SINGDLinearOperator`, checkpoints between devices), with all
optimizer state on the GPU; AMP float16, bfloat16 and float16 parameters
train; the zoo's models drift between devices no more than under AdamW.
`--time` adds step times on a GPT-2-sized model.
"""

from __future__ import annotations

import copy
import io
import sys
import time
import traceback

import numpy as np
import torch
from comparison import CPU, flat, rel, state_devices
from torch import nn
from torch.nn import functional as F

from singd_curvlinops import EKFAC, KFAC, SINGD, SINGDLinearOperator

sys.path.insert(0, ".")  # the repository root: the zoo of tests/models
DEVICE = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
TOL = 1e-10
RESULTS: list[tuple[str, bool, str]] = []


def report(name: str, ok: bool, detail: str) -> None:
    RESULTS.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def check(name: str):
    def decorate(fn):
        def run():
            try:
                fn(name)
            except Exception:
                report(name, False, "exception\n" + traceback.format_exc())

        return run

    return decorate


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(48, 16),
        nn.ReLU(),
        nn.Linear(16, 5),
    ).double()


def data(step: int, device: torch.device, dtype=torch.float64):
    g = torch.Generator().manual_seed(step)
    X = torch.randn(12, 2, 4, 4, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randint(0, 5, (12,), generator=g)
    return X.to(device), y.to(device)


def trajectory(device, cls, options, steps=6, resume=None):
    """Train `steps` steps; optionally from a state dict (model, optimizer)."""
    model = small_model().to(device)
    optimizer = cls(model, **options)
    first = 0
    if resume is not None:
        model_state, opt_state, first = resume
        model.load_state_dict(model_state)
        optimizer.load_state_dict(opt_state)
    for step in range(first, steps):
        X, y = data(step, device)
        optimizer.zero_grad()
        F.cross_entropy(model(X), y).backward()
        optimizer.step()
    return model, optimizer


BASE = {
    "lr": 0.1,
    "lr_cov": 0.1,
    "T": 2,
    "momentum": 0.5,
    "alpha1": 0.5,
    "damping": 1e-3,
    "weight_decay": 1e-3,
}
STRUCTURES = [
    "dense",
    "diagonal",
    "block3diagonal",
    "hierarchical3_2",
    "triltoeplitz",
    "triutoeplitz",
    "trilbottomrightdiag",
    "triltopleftdiag",
    "triubottomrightdiag",
    "triutopleftdiag",
]
CASES = [(f"singd[{s}]", SINGD, {**BASE, "structures": (s, s)}) for s in STRUCTURES]
CASES += [
    (
        "singd[dense,T=1,reduce]",
        SINGD,
        {**BASE, "T": 1, "structures": ("dense", "dense"), "kfac_approx": "reduce"},
    ),
    (
        "singd[normalize_lr_cov]",
        SINGD,
        {**BASE, "structures": ("dense", "diagonal"), "normalize_lr_cov": True},
    ),
    (
        "singd[graft=adamw]",
        SINGD,
        {**BASE, "structures": ("dense", "dense"), "graft": "adamw"},
    ),
    ("ikfac", SINGD, {**BASE, "kfac_like": True, "structures": ("dense", "dense")}),
    ("kfac", KFAC, {"lr": 0.05, "momentum": 0.5, "damping": 0.1, "T": 2}),
    ("ekfac", EKFAC, {"lr": 0.05, "momentum": 0.5, "damping": 0.1, "T": 2}),
]


def trajectories() -> None:
    for name, cls, options in CASES:

        @check(f"trajectory {name} cuda==cpu float64")
        def one(label, cls=cls, options=options):
            cpu_model, _ = trajectory(CPU, cls, options)
            gpu_model, gpu_opt = trajectory(DEVICE, cls, options)
            r = rel(flat(gpu_model.parameters()), flat(cpu_model.parameters()))
            devices = state_devices(gpu_opt)
            moved = rel(flat(gpu_model.parameters()), flat(small_model().parameters()))
            report(
                label,
                r < TOL and devices <= {DEVICE.type} and moved > 1e-3,
                f"rel diff {r:.1e}, state devices {sorted(devices)}, moved {moved:.2e}",
            )

        one()


@check("checkpoint cuda->cpu and cpu->cuda continue")
def checkpoints(label):
    _, cls, options = CASES[0]
    ref_model, _ = trajectory(CPU, cls, options)
    details, ok = [], True
    for src, dst in ((DEVICE, CPU), (CPU, DEVICE)):
        model, optimizer = trajectory(src, cls, options, steps=3)
        buffer = io.BytesIO()
        torch.save({"m": model.state_dict(), "o": optimizer.state_dict()}, buffer)
        buffer.seek(0)
        saved = torch.load(buffer, map_location=dst, weights_only=True)
        resumed, opt = trajectory(
            dst, cls, options, steps=6, resume=(saved["m"], saved["o"], 3)
        )
        r = rel(flat(resumed.parameters()), flat(ref_model.parameters()))
        devices = state_devices(opt)
        ok &= r < TOL and devices <= {dst.type}
        details.append(f"{src.type}->{dst.type} rel {r:.1e} state {sorted(devices)}")
    # a CUDA checkpoint loaded without map_location into a CPU model's optimizer
    model, optimizer = trajectory(DEVICE, cls, options, steps=3)
    live = (model.state_dict(), optimizer.state_dict(), 3)
    cpu_model, cpu_opt = trajectory(CPU, cls, options, steps=6, resume=live)
    r = rel(flat(cpu_model.parameters()), flat(ref_model.parameters()))
    devices = state_devices(cpu_opt)
    ok &= r < TOL and devices <= {"cpu"}
    details.append(f"live cuda state into cpu optimizer rel {r:.1e} {sorted(devices)}")
    report(label, ok, "; ".join(details))


@check("SINGDLinearOperator cuda==cpu")
def linear_operator(label):
    _, cls, options = CASES[0]
    _, cpu_opt = trajectory(CPU, cls, options)
    _, gpu_opt = trajectory(DEVICE, cls, options)
    cpu_op, gpu_op = SINGDLinearOperator(cpu_opt), SINGDLinearOperator(gpu_opt)
    v = np.random.default_rng(0).standard_normal(cpu_op.shape[1])
    a = cpu_op.to_scipy() @ v
    b = gpu_op.to_scipy() @ v
    r = float(np.abs(a - b).max() / np.abs(a).max())
    tv = torch.from_numpy(v).to(DEVICE)
    c = (gpu_op @ tv).detach().cpu().numpy()
    r2 = float(np.abs(a - c).max() / np.abs(a).max())
    report(label, r < TOL and r2 < TOL, f"scipy rel {r:.1e}, torch @ rel {r2:.1e}")


@check("guard peaks: CUDA's _foreach_norm gives the exact peaks, NaN and inf included")
def guard_peaks(label):
    """`bounds.abs_peaks` reduces CUDA tensors with one `torch._foreach_norm`;
    its peaks must be exactly the largest absolute entries, for every dtype,
    strided views, infinities and NaN (the guard's verdicts read them). On a
    device other than CUDA (a dry run) that reduction is forced."""
    from singd_curvlinops import bounds

    fused = bounds.fused_peaks
    if DEVICE.type != "cuda":
        bounds.fused_peaks = lambda tensors: True
    generator = torch.Generator().manual_seed(0)
    mismatches = []
    try:
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            matrix = (3 * torch.randn(40, 30, generator=generator)).to(dtype)
            cases = [[matrix], [matrix.T], [matrix[:, 3]], [matrix, matrix[5]]]
            for poison in (float("inf"), -float("inf"), float("nan")):
                bad = matrix.clone()
                bad[7, 3] = poison
                cases += [[bad], [bad[:, 3], matrix]]
            for tensors in cases:
                on_device = [t.to(DEVICE) for t in tensors]
                assert bounds.fused_peaks(on_device)
                peaks = bounds.abs_peaks(on_device, DEVICE, torch.float64).cpu()
                exact = torch.stack([t.double().abs().max() for t in tensors])
                if not torch.equal(peaks.nan_to_num(-1.0), exact.nan_to_num(-1.0)):
                    mismatches.append((dtype, peaks.tolist(), exact.tolist()))
                finite = bool(bounds.finite(on_device, DEVICE))
                if finite != bool(exact.isfinite().all()):
                    mismatches.append((dtype, "finite", finite))
    finally:
        bounds.fused_peaks = fused
    report(label, not mismatches, f"{len(mismatches)} mismatches {mismatches[:3]}")


@check("set_curvature type-2 KFACLinearOperator cuda==cpu")
def set_curvature(label):
    from curvlinops import FisherType, KFACLinearOperator

    def run(device):
        model = small_model().to(device)
        optimizer = SINGD(model, **{**BASE, "T": 1, "structures": ("dense", "dense")})
        loss_func = nn.CrossEntropyLoss()
        for step in range(3):
            X, y = data(step, device)
            kfac = KFACLinearOperator(
                model,
                loss_func,
                list(model.parameters()),
                [(X, y)],
                fisher_type=FisherType.TYPE2,
                separate_weight_and_bias=False,
                check_deterministic=False,
            )
            optimizer.set_curvature(kfac)
            optimizer.zero_grad()
            loss_func(model(X), y).backward()
            optimizer.step()
        return model

    r = rel(flat(run(DEVICE).parameters()), flat(run(CPU).parameters()))
    report(label, r < TOL, f"rel diff {r:.1e}")


def amp_model(device, dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 128),
        nn.ReLU(),
        nn.Linear(128, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    ).to(device, dtype)


def amp_data(device, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(256, 64, generator=g)
    W = torch.randn(64, 10, generator=g)
    y = (X @ W).argmax(1)
    return X.to(device, dtype), y.to(device)


@check("AMP float16 autocast + GradScaler (with clipping) trains on cuda")
def amp(label):
    details, ok = [], True
    for clip in (False, True):
        model = amp_model(DEVICE)
        optimizer = SINGD(
            model, lr=0.05, lr_cov=0.05, T=2, structures=("dense", "dense")
        )
        scaler = torch.amp.GradScaler(DEVICE.type)
        X, y = amp_data(DEVICE)
        losses = []
        for _ in range(30):
            optimizer.zero_grad()
            with torch.autocast(device_type=DEVICE.type, dtype=torch.float16):
                loss = F.cross_entropy(model(X).float(), y)
            scaler.scale(loss).backward()
            if clip:
                scaler.unscale_(optimizer)
                optimizer.set_current_grad_scale(scaler.get_scale())
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.item())
        finite = all(np.isfinite(losses))
        good = finite and losses[-1] < 0.7 * losses[0]
        ok &= good
        details.append(
            f"clip={clip}: loss {losses[0]:.3f}->{losses[-1]:.3f}, "
            f"skipped {optimizer.skipped_steps}, scale {scaler.get_scale():.0f}"
        )
    # float32 without AMP, the same hyperparameters, for comparison
    model = amp_model(DEVICE)
    optimizer = SINGD(model, lr=0.05, lr_cov=0.05, T=2, structures=("dense", "dense"))
    X, y = amp_data(DEVICE)
    for _ in range(30):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(X), y)
        loss.backward()
        optimizer.step()
    details.append(f"float32 reference final loss {loss.item():.3f}")
    report(label, ok, "; ".join(details))


def low_precision_singd(model, factors):
    """SINGD for a low-precision model; `factors`: the factors' dtype (None: the
    parameters').
    """
    return SINGD(
        model,
        lr=0.05,
        lr_cov=0.05,
        T=2,
        structures=("diagonal", "dense"),
        preconditioner_dtype=(factors, factors),
    )


@check("bfloat16 params (float32 factors) and float16 params + scaler on cuda")
def low_precision(label):
    details, ok = [], True
    for dtype, factors, scaled in (
        (torch.bfloat16, torch.float32, False),
        (torch.bfloat16, None, False),
        (torch.float16, torch.float32, True),
    ):
        model = amp_model(DEVICE, dtype)
        optimizer = low_precision_singd(model, factors)
        scaler = torch.amp.GradScaler(DEVICE.type) if scaled else None
        X, y = amp_data(DEVICE, dtype)
        losses = []
        for _ in range(30):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(X).float(), y)
            if scaler:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            losses.append(loss.item())
        good = all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0]
        ok &= good
        details.append(
            f"{dtype} factors {factors}: {losses[0]:.3f}->{losses[-1]:.3f}"
            f" skipped {optimizer.skipped_steps}"
        )
    report(label, ok, "; ".join(details))


def zoo_on(device, name, dtype):
    from tests.models.zoo import MODELS

    torch.manual_seed(0)
    model, loss_fn = MODELS[name]()
    model = model.to(device, dtype)
    if loss_fn.__closure__:
        for cell in loss_fn.__closure__:
            value = cell.cell_contents
            if torch.is_tensor(value):
                value = value.to(device)
                cell.cell_contents = (
                    value.to(dtype) if value.is_floating_point() else value
                )
    return model, loss_fn


def zoo_steps(device, name, make_optimizer, steps: int = 3):
    """Float64 steps of a zoo model in evaluation mode (no dropout).

    Returns:
        The flat parameters on the CPU after each step, and the optimizer.
    """
    model, loss_fn = zoo_on(device, name, torch.float64)
    model.eval()
    optimizer = make_optimizer(model)
    trajectory = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss_fn(model).backward()
        optimizer.step()
        trajectory.append(flat(model.parameters()))
    return trajectory, optimizer


def zoo_singd(model):
    """SINGD as the zoo's float64 comparisons run it (structures chosen per layer)."""
    return SINGD(model, lr=0.05, lr_cov=0.05, T=1, structures="auto")


def zoo_adamw(model):
    """AdamW for the zoo models' own drift between devices."""
    return torch.optim.AdamW(model.parameters(), lr=0.05)


ZOO = [
    "resnet18",
    "mobilenet_v3_small",
    "vit_tiny",
    "convnext_atto",
    "swin",
    "transformer_encoder",
    "llama",
    "gpt2",
    "bert",
]


def zoo() -> None:
    for name in ZOO:

        @check(f"zoo {name}: cuda==cpu float64 (eval), cuda float32 train")
        def one(label, name=name):
            cpu, _ = zoo_steps(CPU, name, zoo_singd)
            gpu, optimizer = zoo_steps(DEVICE, name, zoo_singd)
            r, devices = rel(gpu[-1], cpu[-1]), state_devices(optimizer)
            # the model's own drift between the devices, under AdamW
            adam_gpu, _ = zoo_steps(DEVICE, name, zoo_adamw)
            adam_cpu, _ = zoo_steps(CPU, name, zoo_adamw)
            r_adam = rel(adam_gpu[-1], adam_cpu[-1])
            model, loss_fn = zoo_on(DEVICE, name, torch.float32)
            optimizer = SINGD(model, lr=0.01, lr_cov=0.01, T=2)
            losses = []
            for _ in range(4):
                optimizer.zero_grad()
                loss = loss_fn(model)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            ok = (
                r < max(1e-10, r_adam)
                and devices <= {DEVICE.type}
                and all(np.isfinite(losses))
            )
            report(
                label,
                ok,
                f"float64 rel diff {r:.1e} (AdamW {r_adam:.1e}), "
                f"state {sorted(devices)}, "
                f"float32 losses {losses[0]:.3f}->{losses[-1]:.3f}, "
                f"{len(optimizer.layers)} layers",
            )

        one()


def time_steps(config, tokens, build, steps: int = 20) -> tuple[float, float, float]:
    """Time training steps of a fresh GPT-2 model with the optimizer `build` gives.

    Returns:
        Milliseconds per step (zero_grad, forward, backward, step; after three
        warm-up steps), the peak GiB allocated while timing, the last loss.
    """
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).to(DEVICE)
    optimizer = build(model)

    def step() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        return loss

    cuda = DEVICE.type == "cuda"
    for _ in range(3):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    if cuda:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / steps * 1e3
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    return ms, peak, loss.item()


def singd(T: int, structure: str, **options):
    """Return a builder of SINGD with (structure, structure) factors."""
    return lambda model: SINGD(
        model, lr=1e-4, lr_cov=1e-3, T=T, structures=(structure, structure), **options
    )


def timings() -> None:
    """Ms per training step on a GPT-2-sized model (6 layers, width 768)."""
    from transformers import GPT2Config

    config = GPT2Config(
        vocab_size=8192,
        n_positions=256,
        n_embd=768,
        n_layer=6,
        n_head=12,
        bos_token_id=0,
        eos_token_id=0,
    )
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 8192, (16, 256), generator=generator).to(DEVICE)
    adamw = ("AdamW", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4))
    wide = (torch.float32, torch.float32)
    setups = [
        adamw,
        ("SINGD dense T=1", singd(1, "dense")),
        ("SINGD dense T=10", singd(10, "dense")),
        ("SINGD diagonal T=1", singd(1, "diagonal")),
        ("SINGD diagonal T=10", singd(10, "diagonal")),
        ("SINGD block32diagonal T=1", singd(1, "block32diagonal")),
        ("KFAC T=10", lambda m: KFAC(m, lr=1e-4, damping=1e-3, T=10)),
    ]
    # EKFAC refuses an embedding tied to the output layer (a documented
    # ValueError), so it is timed on the untied model, with AdamW for its ratio.
    untied = copy.deepcopy(config)
    untied.tie_word_embeddings = False
    runs = [(config, name, build) for name, build in setups]
    runs.append(
        (
            config,
            "SINGD dense T=1, bfloat16 model, float32 factors",
            lambda m: singd(1, "dense", preconditioner_dtype=wide)(m.bfloat16()),
        )
    )
    runs += [(untied, "AdamW (untied)", adamw[1])]
    runs += [
        (untied, "EKFAC T=10 (untied)", lambda m: EKFAC(m, lr=1e-4, damping=1e-3, T=10))
    ]
    base = {}
    for model_config, name, build in runs:
        try:
            ms, peak, loss = time_steps(model_config, tokens, build)
        except Exception:
            print(f"TIME {name}: exception\n{traceback.format_exc()}", flush=True)
            continue
        base.setdefault(model_config.tie_word_embeddings, ms)  # AdamW comes first
        ratio = ms / base[model_config.tie_word_embeddings]
        print(
            f"TIME {name}: {ms:.1f} ms/step ({ratio:.2f}x AdamW), peak {peak:.2f} GiB,"
            f" loss {loss:.3f}",
            flush=True,
        )
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print(f"torch {torch.__version__}, device {DEVICE}", flush=True)
    t0 = time.time()
    trajectories()
    checkpoints()
    linear_operator()
    guard_peaks()
    set_curvature()
    amp()
    low_precision()
    zoo()
    print(f"checks took {time.time() - t0:.0f} s", flush=True)
    if "--time" in sys.argv:
        timings()
    failed = [name for name, ok, _ in RESULTS if not ok]
    print(
        f"SUMMARY {len(RESULTS) - len(failed)} passed, {len(failed)} failed: {failed}"
    )
