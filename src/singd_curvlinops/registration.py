"""How a Kronecker optimizer registers its parameter groups (a mixin of the shell).

The constructor's groups are resolved together, once all are added, so that a
layer's weight and bias may sit in different groups; a later `add_param_group`
resolves its group alone. Resolution (`LayerSet.resolve`) turns parameters into
layers (hooks, factor state, momentum buffers) and the rest into fallback
parameters (their rule's state), or raises before anything changes.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch.nn import Embedding, EmbeddingBag, Module, Parameter

from singd_curvlinops import parameter_update
from singd_curvlinops._warnings import warn
from singd_curvlinops.layers import Layer
from singd_curvlinops.layers.layer_set import unowned_message
from singd_curvlinops.option_guard import check_scalars_fit
from singd_curvlinops.rules.fallback import FALLBACK_RULES
from singd_curvlinops.verdicts import init_counters


class Registration:
    """Parameter-group registration of `KroneckerOptimizer` (see the module docs)."""

    def _default_params(
        self, warn_unsupported: bool, fallback: str | None
    ) -> list[Parameter]:
        """Return the default group's parameters; warn about left-out ones.

        Args:
            warn_unsupported: Whether to warn about left-out parameters.
            fallback: The default fallback rule (None: leave the others out).

        Returns:
            Every trainable parameter, or without a fallback only those of the
            supported layers.
        """
        params, left_out = self._layers.default_params(fallback is not None)
        if left_out and warn_unsupported:
            warn(
                f"{type(self).__name__} leaves out the parameters of unsupported "
                f"layers (optimize them with another optimizer, or pass "
                f"fallback='adamw'): {', '.join(left_out)}."
            )
        return params

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group; its layers get hooks and are trained from now on.

        Args:
            param_group: As for any `torch.optim.Optimizer`; the options may be
                given per group.

        Raises:
            ValueError: If a parameter belongs to no supported layer while the
                group has no fallback, a layer is given only in part, or an
                option is out of range.
            TypeError: If an option has the wrong type.
        """
        super().add_param_group(param_group)
        try:
            self._rule.check_group(self.param_groups[-1])
            where = f"param_groups[{len(self.param_groups) - 1}]"
            check_scalars_fit(self.param_groups[-1], where=where)
            if not self._constructing:  # the constructor registers its groups at once
                self._register()
        except (ValueError, TypeError):
            self.param_groups.pop()
            raise

    def _register(self) -> None:
        """Resolve the groups added since the last call into layers and fallbacks.

        Raises:
            ValueError: If a parameter belongs to no layer and its group has no
                fallback, or a layer is given only in part; nothing changes then.
        """
        indices = range(self._registered, len(self.param_groups))
        batch = {p: i for i in indices for p in self.param_groups[i]["params"]}
        layers, unowned = self._layers.resolve(batch, self.param_groups)
        refused = [
            p for p in unowned if self.param_groups[batch[p]]["fallback"] is None
        ]
        if refused:
            raise ValueError(unowned_message(refused, self._layers))
        trained = [p for p in unowned if p.requires_grad]
        sparse = sparse_gradient_params(self._layers.model, trained)
        if sparse:
            raise ValueError(
                f"{', '.join(map(repr, sparse))}: sparse gradients "
                "(nn.Embedding/EmbeddingBag with sparse=True); the fallback rules "
                "need dense ones. Build the module with sparse=False, or leave its "
                "parameters out of this optimizer."
            )
        self._layers.keep(layers)
        self._registered = len(self.param_groups)
        for layer in layers:
            self._collector.attach(layer)
            self._init_state(layer, self.param_groups[layer.group_index])
        for param in unowned:  # eager: state_dict() is complete
            group = self.param_groups[batch[param]]
            self._fallback.add(param)
            self.state[param].update(
                FALLBACK_RULES[group["fallback"]].init_state(param)
            )
        owned = [p for layer in layers for p in layer.params]
        weights = [layer.weight for layer in layers]
        init_counters(self.state, owned + list(unowned), weights)
        self._options.check(self.param_groups, indices)  # the options they built

    def _check_dormant(self) -> None:
        """Raise if a parameter frozen at its registration has a gradient now.

        Raises:
            ValueError: Naming the parameters; nothing has changed.
        """
        woken = [p for p in self._layers.dormant if p.grad is not None]
        if woken:
            names = ", ".join(sorted(repr(self._layers.name(p)) for p in woken))
            raise ValueError(
                f"{names}: frozen (requires_grad=False) when {type(self).__name__} "
                "registered them, so no layer preconditions them (a layer's factors "
                "are sized at registration) and no fallback trains them; they have "
                "gradients now. Build the optimizer after unfreezing them."
            )

    def _init_all_states(self) -> None:
        """Give every layer and fallback parameter its initial state (a fresh start)."""
        groups = self.param_groups
        for layer in self._layers.active(groups):
            self._init_state(layer, groups[layer.group_index])
        for group, param in self._fallback_params(groups):
            self.state[param].update(
                FALLBACK_RULES[group["fallback"]].init_state(param)
            )

    def _init_state(self, layer: Layer, group: dict[str, Any]) -> None:
        """Create a layer's state: factors, counters, momentum and grafting buffers.

        Args:
            layer: The layer.
            group: Its parameter group.
        """
        state = self.state[layer.weight]
        dtypes = layer.factor_dtypes(group)
        options = layer.options(group)
        state.update(
            self._rule.init_state(options, layer.dims, dtypes, layer.weight.device)
        )
        state["step"] = 0
        # scale of the output gradients expected in the next backward pass
        state["grad_scale"] = self._init_grad_scale
        for param in layer.params:  # every parameter has state (as DCP expects);
            # a zero buffer makes the first momentum step the step itself
            self.state[param]["momentum_buffer"] = torch.zeros_like(param)
        if group["graft"] == "adamw":  # (the moments, zero)
            states = [self.state[param] for param in layer.params]
            parameter_update.graft_moments(layer, states)


def sparse_gradient_params(model: Module, params: Collection[Parameter]) -> list[str]:
    """Return the names of those of `params` that get sparse gradients.

    Args:
        model: The network.
        params: Parameters that no layer owns.

    Returns:
        The names of the weights of `params`' sparse embeddings, in module order.
    """
    kinds = (Embedding, EmbeddingBag)
    return [
        f"{name}.weight" if name else "weight"
        for name, module in model.named_modules()
        if isinstance(module, kinds)
        and module.sparse
        and any(module.weight is p for p in params)
    ]
