r"""Parameter updates besides the factor rule: per-parameter options, grafting.

**A layer's step.** The preconditioned direction \(\Delta = P_C \Gamma P_K\) is split
into one tensor per parameter, and each parameter takes the learning rate,
momentum and weight decay of *its own* parameter group (`update.parameter_step`):
a layer whose weight and bias sit in different groups (no weight decay on biases)
is preconditioned jointly, with the weight's group's factor options, and stepped
per parameter. A parameter without a gradient in a step (frozen, or unused) is not
touched: no momentum, no weight decay.

**Grafting** (`graft="adamw"` or `"sgd"` in the layer's group, Agarwal et al.,
2020, as Distributed Shampoo grafts): the layer's direction is rescaled to the norm
of the grafted optimizer's direction on the same gradient,

\[
\Delta \gets \frac{\lVert D \rVert_F}{\lVert \Delta \rVert_F}\, \Delta, \qquad
D = \Gamma \ \text{(SGD)} \quad\text{or}\quad
D = \hat m / (\sqrt{\hat v} + \epsilon) \ \text{(AdamW's moments of } \Gamma\text{)},
\]

before weight decay, momentum and the learning rate: SINGD picks the direction,
the grafted optimizer the step size, layer by layer. The AdamW moments use the
group's `fallback_betas` and `fallback_eps` and live in the layer's state as
`"graft_exp_avg"`, `"graft_exp_avg_sq"` (layout of \(\Gamma\); under FSDP2 a
`DTensor` of the rank's rows or columns, `fsdp.gamma_zeros`, whose norms
`LayerStepper.apply` sums over the ranks). Where FSDP2's blocks are not shards
of \(\Gamma\) (`fsdp.split_bias`: Hugging Face's `Conv1D`, whose weight it
splits by columns of \(\Gamma\) and whose bias by rows) the moments are kept
per parameter instead, each in its parameter's state, shape and sharding (as
its momentum buffer: `graft_moments`).

**Fallback parameters** go through their group's `FallbackRule`
(`rules.fallback`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.nn import Parameter

from singd_curvlinops.distributed.fsdp import (
    block_parts,
    gamma_zeros,
    local,
    split_bias,
)
from singd_curvlinops.layers import Layer
from singd_curvlinops.rules.fallback import (
    FALLBACK_RULES,
    FallbackRule,
    adam_directions,
)
from singd_curvlinops.update import checked_parameter_steps


def graft_norm(
    grad: Tensor | None,
    states: Sequence[dict[str, Any]],
    group: Mapping[str, Any],
    layer: Layer,
) -> Tensor | None:
    r"""Return \(\lVert D \rVert_F\), the norm of the grafted direction (or None).

    Under FSDP2, of this rank's block of \(D\) (`grad` is this rank's block of
    \(\Gamma\), the moments are sharded alike); `LayerStepper.apply` sums the
    squares over the ranks.

    Args:
        grad: The layer's \(\Gamma\) (block), unscaled (not modified); None: no
            gradient on this rank (a zero norm, no moment changes).
        states: The state entries of the layer's parameters, the weight's first
            (AdamW moments updated in place; the weight's `"step"` already
            counts this step; grafting switched on after construction keeps its
            own count, `"graft_step"`).
        group: The layer's group.
        layer: The layer (for the moments' layout).

    Returns:
        A 0-d tensor, or None without grafting.
    """
    graft = group["graft"]
    if graft is None:
        return None
    if grad is None:
        return torch.zeros((), device=local(layer.weight).device)
    blocks = graft_blocks(layer, grad)
    if graft == "sgd":
        return joint_norm(blocks)
    state = states[0]
    if "graft_exp_avg" not in state:  # switched on later: count its own steps
        state["graft_step"] = torch.zeros((), dtype=torch.int64)
    moments = graft_moments(layer, states)
    if "graft_step" in state:  # (AdamW's bias correction counts grafted steps)
        state["graft_step"].add_(1)
    directions = adam_directions(
        blocks,
        [local(entry["graft_exp_avg"]) for entry in moments],
        [local(entry["graft_exp_avg_sq"]) for entry in moments],
        steps=[int(state.get("graft_step", state["step"]))] * len(blocks),
        betas=group["fallback_betas"],
        eps=group["fallback_eps"],
    )
    return joint_norm(directions)


def graft_blocks(layer: Layer, matrix: Tensor) -> list[Tensor]:
    r"""Return the tensors in which grafting keeps its moments, from a \(\Gamma\) block.

    Args:
        layer: The layer.
        matrix: This rank's block of \(\Gamma\) (or of \(\Delta\)).

    Returns:
        `[matrix]`; for a layer with `fsdp.split_bias`, this rank's parts of the
        weight (in its layout) and of the bias (`fsdp.block_parts`).
    """
    if not split_bias(layer):
        return [matrix]
    return block_parts(layer, matrix)


def graft_moments(layer: Layer, states: Sequence[dict[str, Any]]) -> list[dict]:
    """Return the entries that hold a layer's AdamW grafting moments, made if new.

    Args:
        layer: The layer.
        states: The state entries of its parameters, the weight's first.

    Returns:
        `[states[0]]` (moments in the layout of Gamma); for a layer with
        `fsdp.split_bias`, every parameter's entry (moments of its shape).
    """
    if not split_bias(layer):
        entries, zeros = [states[0]], [lambda: gamma_zeros(layer)]
    else:
        entries = list(states)
        zeros = [partial(torch.zeros_like, param) for param in layer.params]
    for entry, make in zip(entries, zeros, strict=True):
        if "graft_exp_avg" not in entry:
            entry["graft_exp_avg"], entry["graft_exp_avg_sq"] = make(), make()
    return entries


def joint_norm(tensors: Sequence[Tensor]) -> Tensor:
    """Return the Frobenius norm of several tensors together.

    Args:
        tensors: The tensors.

    Returns:
        A 0-d tensor.
    """
    if len(tensors) == 1:
        return torch.linalg.vector_norm(tensors[0])
    return torch.linalg.vector_norm(torch.stack([t.norm() for t in tensors]))


def rescale(direction: Tensor, norm: Tensor, current: Tensor | None = None) -> Tensor:
    r"""Rescale `direction` in place to Frobenius norm `norm` (zero stays zero).

    Args:
        direction: \(\Delta\) (or this rank's block of it).
        norm: The target norm.
        current: \(\lVert \Delta \rVert_F\) (default: `direction`'s own norm;
            under FSDP2 the norm over every rank's block).

    Returns:
        `direction`.
    """
    if current is None:
        current = torch.linalg.vector_norm(direction)
    tiny = torch.finfo(current.dtype).tiny
    return direction.mul_((norm / current.clamp(min=tiny)).to(direction.dtype))


def layer_steps(
    layer: Layer,
    direction: Tensor,
    groups: Sequence[Mapping[str, Any]],
    state: Mapping[Parameter, dict[str, Any]],
    *,
    local: Callable[[Tensor], Tensor] = lambda tensor: tensor,
    parts: list[Tensor] | None = None,
) -> tuple[Tensor, Callable[[Tensor], None]] | None:
    r"""Prepare a layer's parameter step; apply it once the verdict is known.

    Weight decay, momentum and learning rate per parameter, with its own group's
    options (`update.checked_parameter_steps`); a parameter without a gradient is
    not touched.

    Args:
        layer: The layer.
        direction: Its direction \(\Delta\), `[d_C, d_K]` (overwritten).
        groups: The optimizer's parameter groups.
        state: The optimizer's state (momentum buffers).
        local: Maps a parameter or buffer to the tensor this rank updates (its
            shard under FSDP2; the identity otherwise).
        parts: The direction split per parameter already (default:
            `layer.from_matrix`; FSDP2's bias beside column shards,
            `fsdp.block_parts`, whose block holds more than the shards).

    Returns:
        Whether every parameter's step is sound (0-d boolean), and the function
        that applies them all given the verdict; None without a gradient.
    """
    params = [local(p) for p in layer.params]
    parts = layer.from_matrix(direction, params) if parts is None else parts
    stepped = [
        (mine, part, local(state[param]["momentum_buffer"]), group)
        for param, mine, part, group in zip(
            layer.params, params, parts, layer.param_groups(groups), strict=True
        )
        if param.grad is not None  # frozen or unused in this step: never touched
    ]
    if not stepped:
        return None
    mine, parts, buffers, param_groups = zip(*stepped, strict=True)
    storage = direction.untyped_storage().data_ptr()
    views = (  # the parts are the whole direction (not a bias's rows of it)
        len(stepped) == len(params)
        and sum(part.numel() for part in parts) == direction.numel()
        and all(part.untyped_storage().data_ptr() == storage for part in parts)
    )
    return checked_parameter_steps(
        mine,
        parts,
        buffers,
        lrs=[group["lr"] for group in param_groups],
        momenta=[group["momentum"] for group in param_groups],
        weight_decays=[group["weight_decay"] for group in param_groups],
        whole=direction if views and direction.is_contiguous() else None,
    )


def unscale_(grad: Tensor, grad_scale: Tensor) -> Tensor:
    """Divide a gradient by a `GradScaler`'s scale in place, in float32 or wider.

    The division runs in the wider of the gradient's dtype and float32 and is
    rounded once into the gradient's dtype: the scale itself need not fit the
    gradient's dtype (the scaler's default `2**16` overflows float16 to `inf`,
    which would silently turn every gradient into zeros). A low-precision
    gradient is widened explicitly. Divided in place by the scale, a
    zero-dimensional float32 tensor, it stays a float16 operation by type
    promotion (a zero-dimensional operand does not widen a dimensioned one of
    the same kind); CUDA casts the scale to float16 for it, `inf`, while the
    CPU kernel happened to divide exactly. That made every scaled float16 step
    a zero step on a GPU before 2026-12-04.

    Args:
        grad: The scaled gradient (overwritten).
        grad_scale: The scale, a one-element tensor.

    Returns:
        `grad`, unscaled.
    """
    wide = torch.promote_types(grad.dtype, torch.float32)
    scale = grad_scale.to(device=grad.device, dtype=wide)
    if grad.dtype == wide:
        return grad.div_(scale)
    return grad.copy_(grad.to(wide).div_(scale))


def step_fallback(
    params: Iterable[tuple[Parameter, Mapping[str, Any]]],
    state: Mapping[Parameter, dict[str, Any]],
    grad_scale: Tensor | None,
    checked: Callable[
        [Sequence[Parameter], Sequence[dict[str, Any]], Callable[[], None]], None
    ],
) -> None:
    """Step the parameters that no layer owns with their groups' fallback rules.

    The parameters of one group that are of one kind (`DTensor`s or plain
    tensors) take their rule's step together, as one batch of `torch._foreach_*`
    operations; the guard still checks each parameter's update on its own.

    Args:
        params: Each parameter with its group.
        state: The optimizer's state.
        grad_scale: The gradients' scale (None: unscaled).
        checked: Runs the in-place update of some parameters (the last argument)
            as checked changes of each parameter and its state
            (`StepGuard.fallback_update`).
    """
    batches: dict[tuple[int, bool], tuple[FallbackRule, Mapping, list, list]] = {}
    for param, group in params:
        if param.grad is None or group["fallback"] is None:
            continue
        grad = param.grad
        if grad_scale is not None:
            grad = unscale_(grad.clone(), grad_scale)
        rule = FALLBACK_RULES[group["fallback"]]
        param_state = state[param]
        if any(key not in param_state for key in rule.state_keys):
            param_state.update(rule.init_state(param))  # the fallback changed
        kind = (id(group), isinstance(param, DTensor))
        _, _, members, grads = batches.setdefault(kind, (rule, group, [], []))
        members.append(param)
        grads.append(grad)
    for rule, group, members, grads in batches.values():
        states = [state[param] for param in members]
        checked(members, states, partial(rule.step, members, grads, states, group))
