"""`LayerSet`: the layers of a model that an optimizer's parameter groups hold.

The set lists the model's supported slots once (`find_sites`), turns newly
registered parameters into `Layer` records (`resolve`, with clear errors for
layers given only in part), names the trainable parameters that no layer owns (for
the fallback rule or the warning about left-out parameters), and finds records
again by parameter or module.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch.nn import Module, Parameter

from singd_curvlinops.layers.layer import Layer
from singd_curvlinops.layers.registry import supported_layers
from singd_curvlinops.layers.resolve import SiteCandidate, find_sites, resolve


class LayerSet:
    """The supported layers of a model, and those that parameter groups hold.

    Args:
        model: The network.

    Attributes:
        model: The network.
        candidates: Its supported slots with a trainable parameter, in module
            order (see `resolve.find_sites`), except empty ones.
        empty: The supported slots with a trainable parameter without entries
            (`Linear(3, 0)`, `Conv2d(0, 8, 3)`, `Embedding(10, 0)`): their
            Kronecker factors would have no rows or columns, so they are not
            preconditioned; their parameters are like those of unsupported layers.
    """

    def __init__(self, model: Module) -> None:
        self.model = model
        self._sites = find_sites(model)
        trained = [s for s in self._sites if any(p.requires_grad for p in s.params)]
        self.dormant: set[Parameter] = set()  # frozen slot parameters registered
        self.empty = [s for s in trained if any(not p.numel() for p in s.params)]
        self.candidates = [s for s in trained if s not in self.empty]
        self._names = {p: name for name, p in model.named_parameters()}
        self._layers: dict[Parameter, Layer] = {}
        self._owned: dict[Parameter, Layer] = {}

    def default_params(self, fallback: bool) -> tuple[list[Parameter], list[str]]:
        """Return the parameters of a default group, and the names of left-out ones.

        Args:
            fallback: Whether parameters that no layer owns are trained by the
                fallback rule.

        Returns:
            The parameters of the supported slots (module order, weight before
            bias), followed with `fallback` by every other trainable parameter of
            the model (model order); without, the names of those others.
        """
        owned = {
            id(p): p for site in self.candidates for p in site.params if p.requires_grad
        }
        others = [p for p in self._names if p.requires_grad and id(p) not in owned]
        if fallback:
            return [*owned.values(), *others], []
        return list(owned.values()), [self._names[p] for p in others]

    def resolve(
        self, batch: Mapping[Parameter, int], groups: Sequence[Mapping[str, Any]]
    ) -> tuple[list[Layer], list[Parameter]]:
        """Return the layers of newly registered parameters (nothing is kept yet).

        Args:
            batch: The new parameters, each with the index of its group.
            groups: The optimizer's parameter groups.

        Returns:
            The new layers, and the new parameters that no layer owns (for the
            fallback rule). A frozen parameter of a supported slot is neither: it
            joins `dormant`, whose parameters no rule trains.
        """
        sites = [
            s
            for s in self._sites
            if s not in self.empty and any(p.requires_grad for p in s.params)
        ]
        layers = resolve(sites, batch, groups, self._names)
        owned = {p for layer in layers for p in layer.params}
        slots = {p for site in self._sites for p in site.params}
        frozen = {p for p in batch if p in slots and not p.requires_grad}
        self.dormant |= frozen
        return layers, [p for p in batch if p not in owned and p not in frozen]

    def keep(self, layers: Sequence[Layer]) -> None:
        """Keep resolved layers.

        Args:
            layers: From `resolve`.
        """
        for layer in layers:
            self._layers[layer.weight] = layer
            self._owned.update(dict.fromkeys(layer.params, layer))

    def name(self, param: Parameter) -> str:
        """Return a parameter's qualified name in the model.

        Args:
            param: A parameter.

        Returns:
            Its name, or its shape for a parameter outside the model.
        """
        return self._names.get(param, f"<parameter of shape {tuple(param.shape)}>")

    def __iter__(self) -> Iterator[Layer]:
        """Iterate over the kept records, in the order of their groups.

        Yields:
            The records.
        """
        yield from self._layers.values()

    def __len__(self) -> int:
        """Return the number of kept records.

        Returns:
            The count.
        """
        return len(self._layers)

    def get(self, weight: Parameter) -> Layer | None:
        """Return the record of a layer by its first parameter.

        Args:
            weight: A parameter.

        Returns:
            The record, or None if `weight` is not a kept layer's first parameter.
        """
        return self._layers.get(weight)

    def owner(self, param: Parameter) -> Layer | None:
        """Return the layer that preconditions `param`, if any.

        Args:
            param: A parameter.

        Returns:
            The record, or None.
        """
        return self._owned.get(param)

    def active(self, param_groups: Sequence[dict[str, Any]]) -> list[Layer]:
        """Return the layers of the current parameter groups, in group order.

        Args:
            param_groups: The optimizer's groups (a user may remove groups).

        Returns:
            The records whose first parameter is in a group.
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


def unowned_message(params: Sequence[Parameter], layers: LayerSet) -> str:
    """Return the message for parameters that no supported layer owns.

    Args:
        params: The parameters.
        layers: The model's layer set (for empty layers among their owners).

    Returns:
        A sentence naming their shapes and the supported layer types.
    """
    return (
        f"{len(params)} parameter(s) of shapes {[tuple(p.shape) for p in params]} "
        f"do not belong to a supported layer ({supported_layers()}) of the model"
        f"{empty_note(layers.empty, params)}; train them with fallback='adamw' or "
        "'sgd' in their parameter group, or with another optimizer."
    )


def empty_note(
    empty: Sequence[SiteCandidate], params: Sequence[Parameter] | None
) -> str:
    """Return a note naming the empty layers (of `params`, if given), or `""`.

    Args:
        empty: `LayerSet.empty`.
        params: Restrict the note to the layers of these parameters (None: all).

    Returns:
        E.g. `" (layers whose weight has no entries are not preconditioned:
        ['fc'])"`.
    """
    ids = None if params is None else {id(p) for p in params}
    names = [
        site.name
        for site in empty
        if ids is None or any(id(p) in ids for p in site.params)
    ]
    if not names:
        return ""
    return f" (layers whose weight has no entries are not preconditioned: {names})"
