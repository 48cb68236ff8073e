r"""From module slots and a parameter group's parameters to `Layer` records.

`find_sites` asks the adapters which modules of a model they handle and lists
their slots. `resolve` turns the parameters of newly registered groups into
layers:

- a trained weight (in the groups and `requires_grad`) is one layer, with every
  slot that applies it as a site: a weight used by several modules or slots
  (weight tying, an attention module's packed projection in cross-attention) is
  preconditioned once, with the statistics of all its uses;
- its bias joins it if every trained bias of its sites is that one bias, used with
  no other weight (then sites without it contribute a zero bias column, as
  curvlinops treats tied weights); otherwise each trained bias is a bias-only
  layer (\(d_K = 1\)) of the sites that add it;
- a frozen parameter (`requires_grad=False`) is not part of any layer: a layer
  with a frozen bias is preconditioned as a layer without bias (its statistics
  are those of the weight alone), one with a frozen weight as a bias-only layer.

A layer's first site (module order), or the first that adds its bias, sets its
orientation; sites that apply the weight transposed (an embedding table tied to an
output layer) feed the layer's twin.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch.nn import (
    Module,
    MultiheadAttention,
    Parameter,
    TransformerDecoderLayer,
    TransformerEncoderLayer,
)
from torch.nn.utils.parametrize import is_parametrized

from singd_curvlinops.layers.base import LayerAdapter, Slot
from singd_curvlinops.layers.functional_qkv import fallback_children
from singd_curvlinops.layers.layer import BiasColumn, Layer, Site, diagonal_sides
from singd_curvlinops.layers.linear import LinearAdapter
from singd_curvlinops.layers.registry import adapter_for
from singd_curvlinops.structure_policy import resolve_structures


@dataclass(frozen=True, eq=False)
class SiteCandidate:
    """A slot of a supported module, before resolution.

    Attributes:
        name: Module name, with the slot's name if it has one.
        module: The module.
        adapter: Its adapter.
        slot: The slot.
        batch_dim: The batch dimension of the module's inputs (`Site`).
        sequence: Whether its inputs are sequences (`Site`).
    """

    name: str
    module: Module
    adapter: LayerAdapter
    slot: Slot
    batch_dim: int = 0
    sequence: bool = False

    @property
    def params(self) -> tuple[Parameter, ...]:
        """The slot's parameters that exist, weight first."""
        return tuple(p for p in (self.slot.weight, self.slot.bias) if p is not None)


def find_sites(model: Module) -> list[SiteCandidate]:
    """Return the slots of the model's supported modules, in module order.

    Children that an adapter handles with their parent (`submodules`) are skipped,
    and so are three kinds of modules whose parameters go to the fallback rule:
    children that their parent applies with `F.linear`, which no module hook
    sees (of an unmatched `nn.MultiheadAttention`), timm's Swin V2 `qkv` where
    its attention calls it as a module, whose hooks would keep padded rows
    (`functional_qkv.fallback_children`), and parametrized modules
    (`torch.nn.utils.parametrize`: `weight_norm`, `spectral_norm`, ...), whose
    weight is computed from other parameters.

    Args:
        model: The network.

    Returns:
        The candidates.
    """
    found, claimed = [], set()
    feed_forward = _feed_forward_linears(model)
    for name, module in model.named_modules():
        if id(module) in claimed:
            continue
        if isinstance(module, MultiheadAttention):  # applies out_proj functionally
            claimed.update(id(child) for child in module.children())
        claimed.update(id(child) for child in fallback_children(module))
        adapter = adapter_for(module)
        if adapter is None or is_parametrized(module):  # (weight_norm, ...)
            continue  # its parameters compute the weight: the fallback's
        claimed.update(id(child) for child in adapter.submodules(module))
        batch_dim = feed_forward.get(id(module), 0)
        sequence = id(module) in feed_forward
        for slot in adapter.slots(module):
            label = f"{name}.{slot.name}" if name and slot.name else name or slot.name
            found.append(
                SiteCandidate(label, module, adapter, slot, batch_dim, sequence)
            )
    return found


def _feed_forward_linears(model: Module) -> dict[int, int]:
    r"""Return the feed-forward `Linear` layers of Transformer layers, by id.

    A `TransformerEncoderLayer` or `TransformerDecoderLayer` applies its `linear1`,
    `linear2` to sequences: `[N, S, d]`, `[S, N, d]` with `batch_first=False`
    (PyTorch's default), or one unbatched `[S, d]`. The Linear statistics take
    dimension 0 as the batch and a 2-D input as rows of examples, so without
    this their \(\nu\) would count positions of a sequence as examples.

    Args:
        model: The network.

    Returns:
        Per module id, the batch dimension of its batched inputs (`Site.batch_dim`,
        with `Site.sequence` set).
    """
    layers = (TransformerEncoderLayer, TransformerDecoderLayer)
    return {
        id(linear): int(not parent.self_attn.batch_first)
        for parent in model.modules()
        if isinstance(parent, layers)
        for linear in (parent.linear1, parent.linear2)
        if type(adapter_for(linear)) is LinearAdapter
    }


def resolve(
    sites: Sequence[SiteCandidate],
    batch: Mapping[Parameter, int],
    groups: Sequence[Mapping[str, Any]],
    names: Mapping[Parameter, str],
) -> list[Layer]:
    """Return the layers of newly registered parameters (see the module docs).

    Args:
        sites: From `find_sites`.
        batch: The new parameters, each with the index of its group.
        groups: The optimizer's parameter groups.
        names: Qualified parameter names (for bias-only layers).

    Returns:
        The layers, in the order of their first parameter in `batch`. A
        `ValueError` names a slot whose trained parameters are only partly in
        `batch`, or a bias shared by slots of opposite orientations.
    """
    trained = [s for s in sites if any(_trained(p, batch) for p in s.params)]
    _check_complete(trained, batch)
    by_weight: dict[Parameter, list[SiteCandidate]] = {}
    by_bias: dict[Parameter, list[SiteCandidate]] = {}
    for site in trained:
        if _trained(site.slot.weight, batch):
            by_weight.setdefault(site.slot.weight, []).append(site)
        if _trained(site.slot.bias, batch):
            by_bias.setdefault(site.slot.bias, []).append(site)
    layers, joined = [], set()
    for weight, weight_sites in by_weight.items():
        bias = _joint_bias(weight, weight_sites, by_bias)
        joined.add(bias)
        layers.append(_weight_layer(weight, bias, weight_sites, batch, groups))
    for bias, bias_sites in by_bias.items():
        if bias not in joined:
            layers.append(_bias_layer(bias, bias_sites, batch, groups, names[bias]))
    order = {p: i for i, p in enumerate(batch)}
    return sorted(layers, key=lambda layer: order[layer.weight])


def _trained(param: Parameter | None, batch: Mapping[Parameter, int]) -> bool:
    """Return whether a slot parameter exists, is trainable and is registered now.

    Args:
        param: The parameter or None.
        batch: The new parameters.

    Returns:
        The answer.
    """
    return param is not None and param.requires_grad and param in batch


def _check_complete(
    sites: Sequence[SiteCandidate], batch: Mapping[Parameter, int]
) -> None:
    """Raise if a slot's trainable parameters are only partly in `batch`.

    Args:
        sites: The slots with a parameter in `batch`.
        batch: The new parameters.

    Raises:
        ValueError: Naming the layer and the missing parameter.
    """
    for site in sites:
        missing = [p for p in site.params if p.requires_grad and p not in batch]
        if missing:
            role = "bias" if missing[0] is site.slot.bias else "weight"
            raise ValueError(
                f"The weight and bias of layer {site.name!r} must be in the same "
                "parameter group or, in the constructor, in any of its groups: its "
                f"{role} is missing. Freeze it (requires_grad=False) to leave it "
                "untrained."
            )


def _joint_bias(
    weight: Parameter,
    weight_sites: Sequence[SiteCandidate],
    by_bias: Mapping[Parameter, Sequence[SiteCandidate]],
) -> Parameter | None:
    """Return the bias preconditioned jointly with `weight`, if there is one.

    Args:
        weight: The weight.
        weight_sites: Its slots.
        by_bias: The slots of every trained bias.

    Returns:
        The single trained bias of the weight's slots, if no slot of another
        weight adds it; else None.
    """
    biases = {
        id(s.slot.bias): s.slot.bias for s in weight_sites if s.slot.bias in by_bias
    }
    if len(biases) != 1:
        return None
    (bias,) = biases.values()
    if any(s.slot.weight is not weight for s in by_bias[bias]):
        return None
    return bias


def _bias_column(
    site: SiteCandidate, bias: Parameter | None, transposed: bool
) -> BiasColumn:
    """Return how a site's input rows end for a layer with bias `bias`.

    Args:
        site: The site.
        bias: The layer's bias, or None.
        transposed: Whether the site is transposed to the layer.

    Returns:
        See `BiasColumn`.
    """
    has_column = site.slot.bias is not None
    if transposed or bias is None:
        return "drop" if has_column else "none"
    if not has_column:
        return "append_zero"
    return "keep" if site.slot.bias is bias else "zero"


def _weight_layer(
    weight: Parameter,
    bias: Parameter | None,
    weight_sites: Sequence[SiteCandidate],
    batch: Mapping[Parameter, int],
    groups: Sequence[Mapping[str, Any]],
) -> Layer:
    """Return the layer of a trained weight and its sites.

    Args:
        weight: The weight.
        bias: Its joint bias, or None.
        weight_sites: The slots that apply it.
        batch: The new parameters with their groups.
        groups: The parameter groups.

    Returns:
        The layer, with a twin if some site applies the weight transposed.
    """
    first = next(
        (s for s in weight_sites if bias is not None and s.slot.bias is bias),
        weight_sites[0],
    )
    sites = _sites(first, bias, weight_sites)
    d_in, d_out = first.adapter.slot_dims(first.module, first.slot)
    dims = (d_in + int(bias is not None), d_out)
    params = (weight,) if bias is None else (weight, bias)
    diagonal = diagonal_sides(sites)
    structures = resolve_structures(first.name, dims, groups[batch[weight]], diagonal)
    layer = Layer(
        name=first.name,
        module=first.module,
        adapter=first.adapter,
        params=params,
        dims=dims,
        group_index=batch[weight],
        group_indices=tuple(batch[p] for p in params),
        sites=sites,
        structures=structures,
    )
    if not any(s.transposed for s in sites):
        return layer
    twin = replace(
        layer,
        name=f"{layer.name} (transposed)",
        dims=dims[::-1],
        sites=(),
        structures=structures[::-1],
        swapped=True,
    )
    return replace(layer, twin=twin)


def _sites(
    first: SiteCandidate,
    bias: Parameter | None,
    weight_sites: Sequence[SiteCandidate],
) -> tuple[Site, ...]:
    """Return a weight's sites, oriented against its first one.

    Args:
        first: The site that sets the layer's orientation.
        bias: The layer's bias, or None.
        weight_sites: The slots that apply the weight.

    Returns:
        The sites.

    Raises:
        ValueError: If a transposed site adds the joint bias.
    """
    sites = []
    for candidate in weight_sites:
        transposed = candidate.slot.transposed != first.slot.transposed
        if transposed and bias is not None and candidate.slot.bias is bias:
            raise ValueError(
                f"The bias of {candidate.name!r} is shared by slots that apply "
                "the weight in opposite orientations."
            )
        column = _bias_column(candidate, bias, transposed)
        sites.append(
            Site(
                candidate.name,
                candidate.module,
                candidate.adapter,
                candidate.slot,
                transposed,
                column,
                candidate.batch_dim,
                candidate.sequence,
            )
        )
    return tuple(sites)


def _bias_layer(
    bias: Parameter,
    bias_sites: Sequence[SiteCandidate],
    batch: Mapping[Parameter, int],
    groups: Sequence[Mapping[str, Any]],
    name: str,
) -> Layer:
    """Return the bias-only layer of a trained bias and the slots that add it.

    Args:
        bias: The bias.
        bias_sites: Its slots.
        batch: The new parameters with their groups.
        groups: The parameter groups.
        name: Its qualified name.

    Returns:
        The layer, `dims = (1, d_out)`.
    """
    sites = tuple(
        Site(
            s.name, s.module, s.adapter, s.slot, False, "only", s.batch_dim, s.sequence
        )
        for s in bias_sites
    )
    first, dims = bias_sites[0], (1, bias.shape[0])
    return Layer(
        name=name,
        module=first.module,
        adapter=first.adapter,
        params=(bias,),
        dims=dims,
        group_index=batch[bias],
        group_indices=(batch[bias],),
        sites=sites,
        structures=resolve_structures(name, dims, groups[batch[bias]]),
        bias_only=True,
    )
