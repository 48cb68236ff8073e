"""From a model and parameter groups to `Layer` records: `LayerSet`.

`find_layers` asks the adapters which modules of a model they handle;
`default_params` lists their parameters (and names the trainable ones no adapter
owns); `resolve_group` turns a parameter group into the records of its layers,
with clear errors for parameters of no supported layer and for layers split across
groups. `LayerSet` keeps the result for an optimizer and finds records again.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch.nn import Module, Parameter

from singd_curvlinops.layers.base import LayerAdapter
from singd_curvlinops.layers.layer import Layer
from singd_curvlinops.layers.registry import adapter_for, supported_layers


@dataclass(frozen=True, eq=False)
class Candidate:
    """A supported layer of the model, before it is assigned to a group.

    Attributes:
        name: Its name in the model.
        module: The module.
        adapter: The adapter of its type.
    """

    name: str
    module: Module
    adapter: LayerAdapter

    @property
    def params(self) -> tuple[Parameter, ...]:
        """Its parameters, weight first."""
        return self.adapter.parameters(self.module)


def find_layers(model: Module) -> dict[Parameter, Candidate]:
    """Return the model's supported layers whose weight is trainable.

    Args:
        model: The network.

    Returns:
        Map from weight to candidate, in module order.
    """
    found: dict[Parameter, Candidate] = {}
    for name, module in model.named_modules():
        adapter = adapter_for(module)
        if adapter is not None and adapter.weight(module).requires_grad:
            found[adapter.weight(module)] = Candidate(name, module, adapter)
    return found


def default_params(
    model: Module, candidates: dict[Parameter, Candidate]
) -> tuple[list[Parameter], list[str]]:
    """Return the supported layers' parameters and the names of all other ones.

    Args:
        model: The network.
        candidates: From `find_layers`.

    Returns:
        The parameters of the supported layers, weight before bias, and the names
        of the model's other trainable parameters.
    """
    params = [p for candidate in candidates.values() for p in candidate.params]
    chosen = set(params)
    left_out = [
        name
        for name, p in model.named_parameters()
        if p.requires_grad and p not in chosen
    ]
    return params, left_out


def resolve_group(
    candidates: dict[Parameter, Candidate], params: Sequence[Parameter], index: int
) -> list[Layer]:
    """Return the `Layer` records of a parameter group's layers.

    Args:
        candidates: From `find_layers`.
        params: The group's parameters.
        index: The group's position in `optimizer.param_groups`.

    Returns:
        The records, in the order of the group's parameters.

    Raises:
        ValueError: If a parameter is not that of a supported layer, or a layer
            is split across groups.
    """
    owner = {p: weight for weight, c in candidates.items() for p in c.params}
    foreign = [p for p in params if p not in owner]
    if foreign:
        raise ValueError(
            f"{len(foreign)} parameter(s) of shapes "
            f"{[tuple(p.shape) for p in foreign]} do not belong to a supported "
            f"layer ({supported_layers()}) of the model; optimize them with "
            "another optimizer."
        )
    in_group = set(params)
    layers = []
    for weight in dict.fromkeys(owner[p] for p in params):
        candidate = candidates[weight]
        if any(p not in in_group for p in candidate.params):
            raise ValueError(
                f"The weight and bias of layer {candidate.name!r} must be in the "
                "same parameter group."
            )
        layers.append(
            Layer(
                name=candidate.name,
                module=candidate.module,
                adapter=candidate.adapter,
                params=candidate.params,
                dims=candidate.adapter.dims(candidate.module),
                group_index=index,
            )
        )
    return layers


class LayerSet:
    """The supported layers of a model, and those that parameter groups hold.

    Args:
        model: The network.
    """

    def __init__(self, model: Module) -> None:
        self.model = model
        self.candidates = find_layers(model)
        self._layers: dict[Parameter, Layer] = {}

    def add_group(self, params: Sequence[Parameter], index: int) -> list[Layer]:
        """Resolve and keep the layers of a new parameter group.

        Args:
            params: The group's parameters.
            index: The group's position in `optimizer.param_groups`.

        Returns:
            The group's new records.
        """
        layers = resolve_group(self.candidates, params, index)
        self._layers.update({layer.weight: layer for layer in layers})
        return layers

    def __iter__(self) -> Iterator[Layer]:
        """Iterate over the kept records, in the order of their groups.

        Yields:
            The records.
        """
        yield from self._layers.values()

    def get(self, weight: Parameter) -> Layer | None:
        """Return the record of a layer by its weight.

        Args:
            weight: A parameter.

        Returns:
            The record, or None if `weight` is not a kept layer's weight.
        """
        return self._layers.get(weight)

    def active(self, param_groups: Sequence[dict[str, Any]]) -> list[Layer]:
        """Return the layers of the current parameter groups, in group order.

        Args:
            param_groups: The optimizer's groups (a user may remove groups).

        Returns:
            The records whose weight is in a group.
        """
        return [
            self._layers[p]
            for group in param_groups
            for p in group["params"]
            if p in self._layers
        ]

    def find(self, layer: Layer | Module) -> Layer:
        """Return a kept record, given it or its module.

        Args:
            layer: A record of this set, or a module.

        Returns:
            The record.

        Raises:
            ValueError: If it is not a kept layer, or the module holds several.
        """
        if isinstance(layer, Layer) and self._layers.get(layer.weight) is layer:
            return layer
        matches = [record for record in self if record.module is layer]
        if len(matches) != 1:
            raise ValueError(
                f"{layer!r:.60} is not the module of exactly one layer of this "
                f"optimizer ({len(matches)} found); pass one of optimizer.layers."
            )
        return matches[0]
