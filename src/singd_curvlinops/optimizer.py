r"""`SINGD`: structured inverse-free natural gradient descent for `torch.optim`.

The optimizer is a thin shell: hooks collect per-layer statistics through
`singd_curvlinops.statistics` (curvlinops' KFAC conventions), `step` applies the
pure updates of `singd_curvlinops.update`, and all per-layer state lives in
`self.state[weight]` as plain tensors (`"K.<name>"`, `"C.<name>"`, `"m_K.<name>"`,
`"m_C.<name>"`) plus the layer's step counter, so that `state_dict()` is complete
and loads with `torch.load(..., weights_only=True)`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module, Parameter
from torch.nn.parallel import DataParallel, DistributedDataParallel
from torch.optim import Optimizer

from singd_curvlinops import distributed, statistics
from singd_curvlinops._hyperparameters import CALLABLE_LR_COV, check_group
from singd_curvlinops.structures import StructuredMatrix, get_structure
from singd_curvlinops.update import (
    FactorHyperparameters,
    all_finite,
    factor_step,
    momentum_increment,
    precondition,
)


class SINGD(Optimizer):
    r"""Structured inverse-free natural gradient descent (Lin et al., ICML 2024).

    Preconditions the weight (and bias) of every `Linear`, `Conv2d` and
    `torch_geometric.nn.GCNConv` layer (see the GNN page of the docs) by
    \(C C^\top \otimes K K^\top\) with structured factors updated inverse-free on the
    empirical Fisher's KFAC statistics (as curvlinops defines them), and applies
    momentum and weight decay as SGD does. Call it like any optimizer:
    `loss.backward(); optimizer.step()`.

    | argument | symbol | meaning |
    |---|---|---|
    | `lr` | \(\beta_2\) | learning rate of the parameters |
    | `momentum` | \(\alpha_2\) | momentum of the parameter update |
    | `damping` | \(\lambda\) | damping of the factor update |
    | `alpha1` | \(\alpha_1\) | Riemannian momentum of the factors |
    | `weight_decay` | \(\gamma\) | L2 weight decay, added to the natural gradient |
    | `T` | \(T\) | update the factors every `T` steps |
    | `lr_cov` | \(\beta_1\) | factor learning rate; a float or a function of the step |
    | `structures` | — | structure names of \((K, C)\), see `get_structure` |
    | `kfac_approx` | — | `"expand"` or `"reduce"` for weight-sharing layers |
    | `loss_average` | — | `None` (sum loss), `"batch"`, `"batch+sequence"` |
    | `kfac_like` | — | IKFAC update (no trace coupling of \(K\) and \(C\)) |
    | `normalize_lr_cov` | — | normalise \(\beta_1\) by the largest momentum entry |
    | `preconditioner_dtype` | — | dtypes of \((K, C)\); `None`: the parameter's |
    | `init_grad_scale` | — | gradient scale of the first step under AMP |

    Every option except `init_grad_scale` and `warn_unsupported` can be set per
    parameter group.

    Args:
        model: The network whose `Linear`, `Conv2d` and `GCNConv` layers are
            preconditioned.
        params: Parameters or parameter groups; default: the parameters of all
            supported layers of `model` (others are left out, with a warning).
        lr: Learning rate \(\beta_2 \ge 0\).
        momentum: Momentum \(\alpha_2 \in [0, 1)\).
        damping: Damping \(\lambda \ge 0\).
        alpha1: Riemannian momentum \(\alpha_1 \in [0, 1)\).
        weight_decay: Weight decay \(\gamma \ge 0\).
        T: Factor update interval, a positive int.
        loss_average: How the loss averages its terms (see `statistics`).
        lr_cov: Factor learning rate \(\beta_1 \ge 0\) or a function `step -> float`.
        structures: Structure names of \(K\) and \(C\).
        kfac_approx: `"expand"` or `"reduce"`.
        warn_unsupported: Warn about parameters of unsupported layers.
        kfac_like: Use the IKFAC update.
        preconditioner_dtype: Dtypes of \(K\) and \(C\) (`None`: the parameter's).
        init_grad_scale: Expected gradient scale of the first step (AMP).
        normalize_lr_cov: Normalise \(\beta_1\) (see `update`).

    Raises:
        ValueError: If an argument is out of range or unknown, or the model has
            no supported layer.
    """

    _step_supports_amp_scaling = True  # `step` unscales gradients and statistics
    _IDENTITY_FACTORS: tuple[str, ...] = ("K", "C")  # the others start at zero
    # the preconditioner is K Kᵀ ⊗ C Cᵀ of the cached factors (KFAC: the factors)
    _FACTORS_ARE_SQUARE_ROOTS = True
    # state prefixes of the per-layer factors and their side (0: input, 1: output)
    _FACTOR_SIDES: tuple[tuple[str, int], ...] = (
        ("K", 0),
        ("C", 1),
        ("m_K", 0),
        ("m_C", 1),
    )

    def __init__(
        self,
        model: Module,
        params: Iterable[Parameter] | Iterable[dict[str, Any]] | None = None,
        lr: float = 0.001,
        momentum: float = 0.9,
        damping: float = 0.001,
        alpha1: float = 0.5,
        weight_decay: float = 0.0,
        T: int = 10,
        loss_average: str | None = "batch",
        lr_cov: float | Callable[[int], float] = 1e-2,
        structures: tuple[str, str] = ("dense", "dense"),
        kfac_approx: str = "expand",
        warn_unsupported: bool = True,
        kfac_like: bool = False,
        preconditioner_dtype: tuple[torch.dtype | None, torch.dtype | None] = (
            None,
            None,
        ),
        init_grad_scale: float = 1.0,
        normalize_lr_cov: bool = False,
    ) -> None:
        if not isinstance(model, Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model)}.")
        if isinstance(init_grad_scale, bool) or not init_grad_scale > 0:
            raise ValueError(f"init_grad_scale must be > 0, got {init_grad_scale!r}.")
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "damping": damping,
            "alpha1": alpha1,
            "weight_decay": weight_decay,
            "T": T,
            "loss_average": loss_average,
            "lr_cov": lr_cov,
            "structures": structures,
            "kfac_approx": kfac_approx,
            "kfac_like": kfac_like,
            "preconditioner_dtype": preconditioner_dtype,
            "normalize_lr_cov": normalize_lr_cov,
        }
        self._check_group(dict(defaults))
        if isinstance(model, DistributedDataParallel) and not (
            torch.distributed.is_available() and torch.distributed.is_initialized()
        ):
            raise ValueError(
                "model is wrapped in DistributedDataParallel, but no torch.distributed "
                "process group is initialised (call init_process_group first)."
            )
        if isinstance(model, (DataParallel, DistributedDataParallel)):
            model = model.module  # hooks go on the wrapped layers
        self._model = model
        self._layers = {
            statistics.layer_weight(module): (name, module)
            for name, module in self._model.named_modules()
            if statistics.is_supported(module)
            and statistics.layer_weight(module).requires_grad
        }
        if not self._layers:
            raise ValueError(
                "model has no supported layer: SINGD preconditions torch.nn.Linear, "
                "torch.nn.Conv2d (padding_mode='zeros') and "
                "torch_geometric.nn.GCNConv layers."
            )
        if params is None:
            params = self._default_params(warn_unsupported)
        self._hooks: dict[Module, Any] = {}
        self._group_index: dict[Parameter, int] = {}
        self._pending: dict[Module, dict[str, Any]] = {}
        self._cache: dict[Module, tuple] = {}
        self._curvature: dict[Module, tuple[Tensor, Tensor]] = {}
        self._warned_no_statistics: set[str] = set()
        self._verified_configuration = ""
        self._init_grad_scale = float(init_grad_scale)
        super().__init__(params, defaults)

    # ------------------------------------------------------------ construction
    def _default_params(self, warn_unsupported: bool) -> list[Parameter]:
        """Return the parameters of the supported layers; warn about the others.

        Args:
            warn_unsupported: Whether to warn about left-out parameters.

        Returns:
            The weights and biases of the supported layers.
        """
        params = [  # weight first, then bias (a GCNConv registers its bias first)
            p
            for _, module in self._layers.values()
            for p in dict.fromkeys(
                [*statistics.layer_params(module), *module.parameters()]
            )
        ]
        chosen = set(params)
        left_out = [
            name
            for name, p in self._model.named_parameters()
            if p.requires_grad and p not in chosen
        ]
        if left_out and warn_unsupported:
            warnings.warn(
                "SINGD leaves out the parameters of unsupported layers (optimize them "
                f"with another optimizer): {', '.join(left_out)}.",
                UserWarning,
                stacklevel=3,
            )
        return params

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group; its layers get hooks and are trained from now on.

        Args:
            param_group: As for any `torch.optim.Optimizer`; SINGD's options may be
                given per group.

        Raises:
            ValueError: If a parameter does not belong to a supported layer of the
                model, a layer's weight and bias are in different groups, or an
                option is out of range.
            TypeError: If an option has the wrong type.
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_group(group)
            self._register_group_layers(group, len(self.param_groups) - 1)
        except (ValueError, TypeError):
            self.param_groups.pop()
            raise

    def _check_group(self, group: dict[str, Any]) -> None:
        """Validate a parameter group's options (subclasses check their own).

        Args:
            group: The group's options.
        """
        check_group(group)

    def _register_group_layers(self, group: dict[str, Any], index: int) -> None:
        """Map the group's layers to it and install their hooks.

        Args:
            group: The new group.
            index: Its position in `self.param_groups`.

        Raises:
            ValueError: If a parameter is not that of a supported layer, or a layer
                is split across groups.
        """
        owner = {
            p: weight
            for weight, (_, module) in self._layers.items()
            for p in module.parameters()
        }
        params = group["params"]
        foreign = [p for p in params if p not in owner]
        if foreign:
            raise ValueError(
                f"{len(foreign)} parameter(s) of shapes "
                f"{[tuple(p.shape) for p in foreign]} do not belong to a supported "
                "layer (torch.nn.Linear, torch.nn.Conv2d, torch_geometric.nn.GCNConv) "
                "of the model; optimize them "
                "with another optimizer."
            )
        ids = set(params)
        for weight in dict.fromkeys(owner[p] for p in params):
            name, module = self._layers[weight]
            if any(p not in ids for p in module.parameters()):
                raise ValueError(
                    f"The weight and bias of layer {name!r} must be in the same "
                    "parameter group."
                )
            self._group_index[weight] = index
            self._hooks[module] = module.register_forward_hook(
                self._forward_hook, with_kwargs=True
            )
            self._layer_state(module)  # eager: state_dict() is complete from the start

    def _group_of(self, weight: Parameter) -> dict[str, Any]:
        """Return the parameter group that holds a layer.

        Args:
            weight: The layer's weight.

        Returns:
            The group's dictionary.
        """
        return self.param_groups[self._group_index[weight]]

    # ------------------------------------------------------------------- state
    def _layer_state(self, module: Module) -> dict[str, Any]:
        """Return the layer's state, creating identity factors on first use.

        Args:
            module: A hooked layer.

        Returns:
            `self.state[weight]` of the layer's weight.
        """
        weight = statistics.layer_weight(module)
        state = self.state[weight]
        if "step" not in state:
            group = self._group_of(weight)
            dims = statistics.factor_dims(module)
            for prefix, name, dim, dtype in self._factor_specs(group, dims, module):
                cls = get_structure(name)
                init = cls.eye if prefix in self._IDENTITY_FACTORS else cls.zeros
                matrix = init(dim, dtype=dtype, device=weight.device)
                for key, tensor in matrix.named_tensors():
                    state[f"{prefix}.{key}"] = tensor
            state["step"] = 0
            # scale of the output gradients expected in the next backward pass
            state["grad_scale"] = self._init_grad_scale
            for param in module.parameters():  # every parameter has state (as DCP
                # expects); a zero buffer makes the first momentum step the step
                self.state[param]["momentum_buffer"] = torch.zeros_like(param)
        return state

    @classmethod
    def _factor_specs(
        cls, group: dict[str, Any], dims: tuple[int, int], module: Module
    ) -> list[tuple[str, str, int, torch.dtype]]:
        """Return `(prefix, structure, dim, dtype)` for `K`, `C`, `m_K`, `m_C`.

        Args:
            group: The layer's parameter group.
            dims: `(d_K, d_C)`.
            module: The layer.

        Returns:
            The four specifications.
        """
        names = group["structures"]
        weight_dtype = statistics.layer_weight(module).dtype
        dtypes = [d or weight_dtype for d in group["preconditioner_dtype"]]
        return [
            (prefix, names[side], dims[side], dtypes[side])
            for prefix, side in cls._FACTOR_SIDES
        ]

    def _load_factor(self, state: dict[str, Any], prefix: str, name: str):
        """Rebuild a structured factor from the layer's state tensors.

        Args:
            state: The layer's state.
            prefix: `"K"`, `"C"`, `"m_K"` or `"m_C"`.
            name: The structure name.

        Returns:
            The structured matrix; its tensors are the state's tensors.
        """
        start = f"{prefix}."
        tensors = {k[len(start) :]: v for k, v in state.items() if k.startswith(start)}
        return get_structure(name).from_tensors(tensors)

    @staticmethod
    def _store_factor(
        state: dict[str, Any], prefix: str, matrix: StructuredMatrix
    ) -> None:
        """Write a structured factor's tensors into the layer's state.

        Args:
            state: The layer's state.
            prefix: `"K"`, `"C"`, `"m_K"` or `"m_C"`.
            matrix: The new value.
        """
        for key, tensor in matrix.named_tensors():
            state[f"{prefix}.{key}"] = tensor

    def _factors(self, module: Module) -> tuple[StructuredMatrix, ...]:
        """Return the layer's `K`, `C`, `m_K`, `m_C`.

        Args:
            module: A hooked layer.

        Returns:
            The four structured matrices.
        """
        state = self._layer_state(module)
        names = self._group_of(statistics.layer_weight(module))["structures"]
        return tuple(
            self._load_factor(state, prefix, names[side])
            for prefix, side in self._FACTOR_SIDES
        )

    def _preconditioner(self, module: Module) -> tuple:
        r"""Return `(K, C, KKᵀ, CCᵀ, m_K, m_C)`, cached until the factors change.

        \(K K^\top\) is None where it leaves the structure (then `precondition`
        applies \(K (K^\top \cdot)\)); the cache is derived data, not state.

        Args:
            module: A hooked layer.

        Returns:
            The factors and their cached outer products.
        """
        cached = self._cache.get(module)
        if cached is None:
            K, C, m_K, m_C = self._factors(module)
            # A dense K Kᵀ costs 2d³ and then 2d²n per use on n columns, applying
            # K and Kᵀ costs 4d²n: forming it pays off if it serves several steps
            # or if d < n (the smaller side of a layer). For sparse structures it
            # costs less than applying K once.
            reuse = self._group_of(statistics.layer_weight(module))["T"] > 1
            KKt, CCt = (
                M.outer_self() if reuse or M.numel() < M.dim**2 or M.dim < n else None
                for M, n in ((K, C.dim), (C, K.dim))
            )
            cached = self._cache[module] = (K, C, KKt, CCt, m_K, m_C)
        return cached

    # ------------------------------------------------------------------- hooks
    # The hooks run eagerly under `torch.compile`: they branch on the optimizer's
    # step counter and mutate its state, which Dynamo would otherwise trace into
    # one specialised graph per layer and phase until it hits its recompile limit.
    @torch.compiler.disable
    def _forward_hook(
        self, module: Module, args: tuple, kwargs: dict[str, Any], output: Tensor
    ) -> None:
        """On update steps, install a tensor hook on the output (no backward hooks).

        Args:
            module: The layer.
            args: Its positional inputs.
            kwargs: Its keyword inputs.
            output: Its output.
        """
        if not torch.is_grad_enabled() or not isinstance(output, Tensor):
            return
        weight = statistics.layer_weight(module)
        if not output.requires_grad or weight not in self._group_index:
            return
        state = self._layer_state(module)
        if state["step"] % self._group_of(weight)["T"] != 0:
            return
        x = statistics.layer_input(module, args, kwargs)
        output.register_hook(partial(self._accumulate, module, x))

    @torch.compiler.disable
    def _accumulate(self, module: Module, x: Tensor, grad_output: Tensor) -> None:
        r"""Add one micro-batch's \(H_K\), \(H_C\) to the layer's pending statistics.

        Args:
            module: The layer.
            x: Its input in the forward pass.
            grad_output: The gradient w.r.t. its output.
        """
        with torch.no_grad():
            group = self._group_of(statistics.layer_weight(module))
            dtype_K, dtype_C = self._factor_dtypes(group, module)
            approx, average = group["kfac_approx"], group["loss_average"]
            a = statistics.input_rows(module, x.to(dtype_K), approx)
            g = statistics.gradient_rows(module, grad_output, approx, average)
            expected_scale = self._layer_state(module)["grad_scale"]
            g = g.to(dtype_C)
            if expected_scale != 1.0:
                g = g / expected_scale
            H_K, H_C = self._statistics(module, a, g)
            batch = x.shape[0]
            pending = self._pending.get(module)
            if pending is None:
                self._pending[module] = {
                    "H_K": H_K,
                    "H_C": H_C,
                    "num_examples": batch,
                    "grad_scale": expected_scale,
                }
                return
            total = pending["num_examples"] + batch
            pending["H_K"].mul_(pending["num_examples"] / total).add_(
                H_K, alpha=batch / total
            )
            pending["H_C"].add_(H_C)
            pending["num_examples"] = total

    # --------------------------------------------------------------- curvature
    def set_curvature(self, kfac: Any) -> None:
        r"""Take the next factor update's statistics from a curvlinops KFAC operator.

        Instead of the empirical Fisher of the training pass, the next update of each
        layer uses \(H_K = \Pi(K^\top A K)\) and \(H_C = \Pi(C^\top G C)\) with the
        operator's Kronecker factors \(A\), \(G\): any `fisher_type` (empirical,
        Monte-Carlo, type-2, forward-only) and any data. The operator's factors are
        computed now if they were not yet.

        Args:
            kfac: A `curvlinops.KFACLinearOperator` over this optimizer's layers,
                built with `separate_weight_and_bias=False`.

        Raises:
            ValueError: If the operator covers other layers than the optimizer, or
                its factors do not match the layers' dimensions.
        """
        factors = statistics.kfac_factors(kfac)
        ours = {w for g in self.param_groups for w in g["params"] if w in self._layers}

        def names(weights: set) -> list[str]:
            return sorted(
                self._layers[w][0] if w in self._layers else str(tuple(w.shape))
                for w in weights
            )

        if set(factors) != ours:
            raise ValueError(
                "The KFACLinearOperator must cover exactly the optimizer's layers: "
                f"missing {names(ours - set(factors))}, extra "
                f"{names(set(factors) - ours)}."
            )
        curvature = {}
        for weight, (U_K, U_C) in factors.items():
            name, module = self._layers[weight]
            if (U_K.shape[0], U_C.shape[0]) != statistics.factor_dims(module):
                raise ValueError(
                    f"Layer {name!r}: the operator's factors have dimensions "
                    f"{(U_K.shape[0], U_C.shape[0])}, the layer "
                    f"{statistics.factor_dims(module)} (is the bias included?)."
                )
            curvature[module] = (U_K.detach(), U_C.detach())
        self._curvature = curvature

    @staticmethod
    def _factor_dtypes(
        group: dict[str, Any], module: Module
    ) -> tuple[torch.dtype, torch.dtype]:
        """Return the dtypes of the input-side and output-side factors.

        Args:
            group: The layer's parameter group.
            module: The layer.

        Returns:
            `preconditioner_dtype`, with None replaced by the weight's dtype.
        """
        dtype_K, dtype_C = group["preconditioner_dtype"]
        weight_dtype = statistics.layer_weight(module).dtype
        return dtype_K or weight_dtype, dtype_C or weight_dtype

    def _statistics(
        self, module: Module, a: Tensor, g: Tensor
    ) -> tuple[StructuredMatrix, StructuredMatrix]:
        r"""Return \(H_K = \Pi(K^\top a^\top a K)\), \(H_C = \Pi(C^\top g^\top g C)\).

        Args:
            module: The layer.
            a: Input rows `[rows, d_K]`, a buffer of ours that `K.from_inner_` may
                overwrite.
            g: Output-gradient rows `[rows, d_C]` (left intact).

        Returns:
            The two projected matrices, without forming `aᵀa` or `gᵀg`.
        """
        K, C = self._preconditioner(module)[:2]
        # `a` is a fresh buffer (`statistics.input_rows`); `g` may be a view of
        # autograd's output gradient and must stay intact
        return K.from_inner_(a.T), C.from_inner(g.T)

    def _zero_statistics(
        self, module: Module
    ) -> tuple[StructuredMatrix, StructuredMatrix]:
        """Return zero statistics in the layer's structures (data parallelism).

        Args:
            module: The layer.

        Returns:
            Zero matrices shaped like `_statistics`' results.
        """
        K, C = self._preconditioner(module)[:2]
        return (
            K.zeros(K.dim, dtype=K.dtype, device=K.device),
            C.zeros(C.dim, dtype=C.dtype, device=C.device),
        )

    # -------------------------------------------------------------------- step
    def set_current_grad_scale(self, grad_scale: float) -> None:
        """Tell the optimizer the gradient scale of the current backward pass.

        Needed only with a `GradScaler` whose `unscale_` is called before `step`
        (e.g. for gradient clipping): the gradients are then unscaled, but the
        statistics collected during the backward pass still carry the scale.

        Args:
            grad_scale: `scaler.get_scale()` of the current step.
        """
        self._current_grad_scale = float(grad_scale)

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        """Update factors (every `T` steps) and parameters.

        Args:
            closure: Optional function that recomputes the loss (forward and
                backward); evaluated with gradients enabled before the update.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        layers = [
            (group, weight, *self._layers[weight])
            for group in self.param_groups
            for weight in group["params"]
            if weight in self._layers and self._group_index.get(weight) is not None
        ]
        grad_scale = getattr(self, "grad_scale", None)  # set by torch.amp.GradScaler
        current_scale = (
            float(grad_scale)
            if grad_scale is not None
            else self.__dict__.pop("_current_grad_scale", None)
        )
        if distributed.world_size() > 1:
            self._all_reduce_statistics(layers)
        if not self._all_finite(layers):
            self._skip_step()
            if current_scale is not None:  # the next pass runs at (about) this scale
                for _, weight, _, _ in layers:
                    if "step" in self.state[weight]:
                        self.state[weight]["grad_scale"] = current_scale
            return loss
        for group, _, name, module in layers:
            state = self._layer_state(module)
            statistics_scale = current_scale or state["grad_scale"]
            self._step_layer(group, name, module, grad_scale, statistics_scale)
            state["grad_scale"] = statistics_scale
        return loss

    def _all_reduce_statistics(self, layers: list) -> None:
        """Replace the pending statistics by those of all processes (data parallel).

        Every process takes part for every layer due for an update, with zero
        statistics where its hooks did not fire; see `distributed` for the math.

        Args:
            layers: `(group, weight, name, module)` tuples, in parameter order.
        """
        description = ";".join(
            f"{name}:{statistics.factor_dims(module)}:{group['structures']}:"
            f"{group['T']}:{group['loss_average']}:{group['kfac_approx']}"
            for group, _, name, module in layers
        )
        if description != self._verified_configuration:
            distributed.check_same_configuration(description, layers[0][1].device)
            self._verified_configuration = description
        due = [
            module
            for group, _, _, module in layers
            if self._layer_state(module)["step"] % group["T"] == 0
        ]
        if not due:
            return
        entries = []
        for module in due:
            pending = self._pending.get(module)
            if pending is None:
                entries.append((*self._zero_statistics(module), 0))
            else:
                entries.append(
                    (pending["H_K"], pending["H_C"], pending["num_examples"])
                )
        totals = distributed.all_reduce_statistics(entries)
        for module, (H_K, H_C, _), total in zip(due, entries, totals, strict=True):
            if total == 0:
                self._pending.pop(module, None)
                continue
            scale = self._layer_state(module)["grad_scale"]
            pending = self._pending.setdefault(module, {"grad_scale": scale})
            pending.update({"H_K": H_K, "H_C": H_C, "num_examples": total})

    def _all_finite(self, layers: list) -> bool:
        """Check gradients and pending statistics for infinities and NaNs.

        One host synchronisation per step decides whether the step is skipped.

        Args:
            layers: `(group, weight, name, module)` tuples.

        Returns:
            Whether every gradient and statistic is finite.
        """
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and bool(found_inf):
            return False
        tensors = []
        if found_inf is None:  # a GradScaler has checked the gradients already
            tensors = [
                p.grad
                for _, _, _, module in layers
                for p in module.parameters()
                if p.grad is not None
            ]
        for pending in self._pending.values():
            tensors += pending["H_K"].tensors() + pending["H_C"].tensors()
        return bool(all_finite(tensors))

    def _skip_step(self) -> None:
        """Skip the step: warn, drop statistics, touch no parameter or factor."""
        self._pending.clear()
        warnings.warn(
            "SINGD skipped a step: non-finite gradients or statistics. Parameters, "
            "factors and momenta are unchanged.",
            UserWarning,
            stacklevel=3,
        )

    def _step_layer(
        self,
        group: dict[str, Any],
        name: str,
        module: Module,
        grad_scale: Tensor | None,
        statistics_scale: float,
    ) -> None:
        """Update one layer's factors (if due) and parameters.

        Args:
            group: The layer's parameter group.
            name: The layer's name in the model.
            module: The layer.
            grad_scale: Scale of the gradients (None: unscaled).
            statistics_scale: Scale of the output gradients in the statistics.
        """
        state = self._layer_state(module)
        if state["step"] % group["T"] == 0:
            self._update_factors(group, name, module, state, statistics_scale)
        else:
            self._pending.pop(module, None)
        state["step"] += 1
        grad = statistics.grad_matrix(module)
        if grad is None:
            return
        if grad_scale is not None:
            grad.div_(grad_scale.to(grad.dtype))
        direction = precondition(
            grad, *self._preconditioner(module)[:4], overwrite=True
        )
        params = statistics.layer_params(module)
        self._apply_update(params, direction, group)

    def _take_statistics(
        self,
        group: dict[str, Any],
        name: str,
        module: Module,
        statistics_scale: float,
    ) -> tuple[bool, Any, Any] | None:
        """Remove and return the statistics for this factor update of a layer.

        Statistics handed over by `set_curvature` take precedence over those the
        hooks collected; without either, the layer is named in a one-time warning.

        Args:
            group: The layer's parameter group.
            name: The layer's name.
            module: The layer.
            statistics_scale: Scale of the output gradients in the statistics.

        Returns:
            `(True, U_K, U_C)` with dense factors from `set_curvature`, or
            `(False, H_K, H_C)` with the collected statistics, `H_C` scaled to the
            convention of `U_C` (loss average, gradient scale); None if none.
        """
        curvature = self._curvature.pop(module, None)
        pending = self._pending.pop(module, None)
        if curvature is not None:
            return True, *curvature
        if pending is None:
            if name not in self._warned_no_statistics:
                self._warned_no_statistics.add(name)
                warnings.warn(
                    f"Layer {name!r} received no statistics (its forward hook did not "
                    "run, e.g. because it is called functionally); its parameters are "
                    "updated with the current factors until statistics arrive.",
                    UserWarning,
                    stacklevel=5,
                )
            return None
        unscale = (pending["grad_scale"] / statistics_scale) ** 2
        N = pending["num_examples"]
        H_C = pending["H_C"]
        H_C.mul_(statistics.gradient_scale(group["loss_average"], N) * unscale)
        return False, pending["H_K"], H_C

    def _update_factors(
        self,
        group: dict[str, Any],
        name: str,
        module: Module,
        state: dict[str, Any],
        statistics_scale: float,
    ) -> None:
        """Apply the Riemannian factor updates of SINGD (or IKFAC) to one layer.

        Args:
            group: The layer's parameter group.
            name: The layer's name.
            module: The layer.
            state: Its state.
            statistics_scale: Scale of the output gradients in the statistics.
        """
        taken = self._take_statistics(group, name, module, statistics_scale)
        if taken is None:
            return
        K, C, _, _, m_K, m_C = self._preconditioner(module)
        handed_over, first, second = taken
        if handed_over:  # dense factors from set_curvature: project Kᵀ U K
            H_K, H_C = (
                M.from_dense(_symmetric(M.rmatmat(M.rmatmat(U.to(M.dtype)).T)))
                for M, U in ((K, first), (C, second))
            )
        else:
            H_K, H_C = first, second
        KtK, CtC = K.from_inner(), C.from_inner()
        traces = [M.average_trace() for M in (H_K, H_C, KtK, CtC)]
        lr_cov = group["lr_cov"]
        hyper = FactorHyperparameters(
            damping=group["damping"],
            alpha1=group["alpha1"],
            lr_cov=lr_cov(state["step"]) if callable(lr_cov) else lr_cov,
            kfac_like=group["kfac_like"],
            normalize_lr_cov=group["normalize_lr_cov"],
        )
        increment_K = momentum_increment(
            H_K, KtK, trace_H_other=traces[1], trace_KtK_other=traces[3], hyper=hyper
        )
        increment_C = momentum_increment(
            H_C, CtC, trace_H_other=traces[0], trace_KtK_other=traces[2], hyper=hyper
        )
        for prefix, factor, momentum, increment in (
            ("K", K, m_K, increment_K),
            ("C", C, m_C, increment_C),
        ):  # the factors' tensors are the state's: updated in place
            self._store_factor(
                state, f"m_{prefix}", factor_step(factor, momentum, increment, hyper)
            )
        self._cache.pop(module, None)

    def _apply_update(
        self, params: list[Parameter], direction: Tensor, group: dict[str, Any]
    ) -> None:
        r"""Apply weight decay, momentum and the learning rate to the parameters.

        \(\mu \gets \alpha_2 \mu + \Delta + \gamma \theta\),
        \(\theta \gets \theta - \beta_2 \mu\) per parameter \(\theta\) (weight,
        bias) with its slice \(\Delta\) of the preconditioned gradient, in place.

        Args:
            params: Weight (and bias) of the layer.
            direction: Preconditioned gradient `[d_out, d_K]` (overwritten).
            group: The parameter group.
        """
        steps = [direction[:, : params[0][0].numel()].reshape_as(params[0])]
        if len(params) == 2:
            steps.append(direction[:, -1].reshape_as(params[1]))
        for param, step in zip(params, steps, strict=True):
            if group["weight_decay"]:
                step.add_(param, alpha=group["weight_decay"])
            if group["momentum"]:
                buffer = self.state[param]["momentum_buffer"]
                # μ ← α₂μ + Δ as one pass: add(Δ, μ, alpha=α₂) written into μ
                step = torch.add(step, buffer, alpha=group["momentum"], out=buffer)  # noqa: PLW2901
            param.add_(step, alpha=-group["lr"])

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return the state as plain tensors and containers (`weights_only` loads it).

        A callable `lr_cov` is replaced by a marker; `load_state_dict` restores the
        callable of the optimizer it loads into.

        Returns:
            The state dictionary.
        """
        state_dict = super().state_dict()
        for group in state_dict["param_groups"]:
            if callable(group.get("lr_cov")):
                group["lr_cov"] = CALLABLE_LR_COV
            group["preconditioner_dtype"] = [
                None if d is None else str(d).removeprefix("torch.")
                for d in group["preconditioner_dtype"]
            ]
            group["structures"] = list(group["structures"])
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state, keeping factors in their own dtype and validating it.

        Args:
            state_dict: From `state_dict()`, possibly of another process or device.

        Raises:
            ValueError: If the state belongs to another model, other structures or
                a callable `lr_cov` the current optimizer does not have.
        """
        state_dict = {
            "state": dict(state_dict["state"]),
            "param_groups": [dict(g) for g in state_dict["param_groups"]],
        }
        callables = [g.get("lr_cov") for g in self.param_groups]
        for group, lr_cov in zip(state_dict["param_groups"], callables, strict=False):
            group["preconditioner_dtype"] = tuple(
                None if d is None else getattr(torch, d)
                for d in group["preconditioner_dtype"]
            )
            group["structures"] = tuple(group["structures"])
            if group.get("lr_cov") == CALLABLE_LR_COV:
                if not callable(lr_cov):
                    raise ValueError(
                        "The checkpoint was saved with a callable lr_cov; construct "
                        "the optimizer with the same callable before loading."
                    )
                group["lr_cov"] = lr_cov
        factors = self._validated_factors(state_dict)
        super().load_state_dict(state_dict)
        for param, tensors in factors.items():
            self.state[param].update(
                {k: t.to(param.device) for k, t in tensors.items()}
            )
        self._pending.clear()
        self._cache.clear()

    def _validated_factors(
        self, state_dict: dict[str, Any]
    ) -> dict[Parameter, dict[str, Tensor]]:
        """Check the loaded factors against the current layers; keep their dtypes.

        Args:
            state_dict: The state to load (already with restored group options).

        Returns:
            Map from weight to its factor tensors, in their saved dtypes.

        Raises:
            ValueError: If groups, structures or shapes do not match.
        """
        params = [p for g in self.param_groups for p in g["params"]]
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or sum(
            len(g["params"]) for g in saved_groups
        ) != len(params):
            raise ValueError(
                "The state has different parameter groups than this optimizer: it "
                "belongs to another model or optimizer configuration."
            )
        index_group = {i: g for g in saved_groups for i in g["params"]}
        factors = {}
        for index, param in enumerate(params):
            saved = state_dict["state"].get(index, {})
            if param not in self._layers or "step" not in saved:
                continue
            group, (_, module) = index_group[index], self._layers[param]
            if tuple(group["structures"]) != self._group_of(param)["structures"]:
                raise ValueError(
                    f"The state uses structures {tuple(group['structures'])}, this "
                    f"optimizer {self._group_of(param)['structures']}."
                )
            dims = statistics.factor_dims(module)
            expected = {}
            for prefix, name, dim, _ in self._factor_specs(group, dims, module):
                for key, tensor in get_structure(name).zeros(dim).named_tensors():
                    expected[f"{prefix}.{key}"] = tensor.shape
            found = {k: v.shape for k, v in saved.items() if k in expected}
            if found != expected:
                raise ValueError(
                    "The state's factor shapes do not match this model's layer "
                    f"{self._layers[param][0]!r}: it belongs to another model."
                )
            factors[param] = {k: saved[k] for k in expected}
        return factors

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore from a pickle, filling options that older versions lacked.

        Args:
            state: The pickled `__dict__`.
        """
        super().__setstate__(state)
        self.__dict__.setdefault("_pending", {})
        self.__dict__.setdefault("_cache", {})
        self.__dict__.setdefault("_curvature", {})
        self.__dict__.setdefault("_verified_configuration", "")
        self.__dict__.setdefault("_warned_no_statistics", set())
        self.__dict__.setdefault("_init_grad_scale", 1.0)


def _symmetric(mat: Tensor) -> Tensor:
    """Return the symmetric part of a square matrix (removes round-off asymmetry).

    Args:
        mat: Square matrix.

    Returns:
        `(mat + mat.T) / 2`.
    """
    return (mat + mat.T) / 2
