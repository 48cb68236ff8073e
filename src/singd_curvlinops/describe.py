"""`optimizer.describe()`: which parameters go to which rule and structure.

One row per preconditioned layer (its rule, the structures and dimensions of its
factors, its number of parameters, the bytes of its state) and one per fallback
parameter; the first line of the printed table sums it up: the share of the
parameters that is preconditioned, the layers, the fallback, the state's bytes.
Once the step guard (`singd_curvlinops.guard`) skipped an update or discarded a
factor update, the table also counts them per layer and parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from torch.nn import Parameter

from singd_curvlinops.verdicts import DISCARDED, SKIPPED


@dataclass(frozen=True)
class SummaryRow:
    """One layer or fallback parameter of an optimizer.

    Attributes:
        name: The layer's name (with the modules it is tied to), or the
            parameter's name.
        rule: `"SINGD"`, `"IKFAC"`, `"KFAC"`, `"AdamW fallback"`, `"SGD fallback"`.
        structures: The factors' structures `"K, C"` (empty for a fallback).
        dims: The factors' dimensions `"d_K x d_C"` (empty for a fallback).
        numel: Number of parameter entries.
        state_bytes: Bytes of the optimizer state of these parameters.
        skipped_steps: Steps in which the guard skipped their update.
        discarded_factor_updates: The layer's factor updates that the guard
            discarded (0 for a fallback parameter).
    """

    name: str
    rule: str
    structures: str
    dims: str
    numel: int
    state_bytes: int
    skipped_steps: int = 0
    discarded_factor_updates: int = 0

    @property
    def preconditioned(self) -> bool:
        """Whether a Kronecker rule (not a fallback) trains these parameters."""
        return not self.rule.endswith("fallback")


@dataclass(frozen=True)
class OptimizerSummary:
    """What an optimizer trains, and how (see the module docs).

    Attributes:
        optimizer: The optimizer's class name.
        rows: The layers, then the fallback parameters.
    """

    optimizer: str
    rows: tuple[SummaryRow, ...]

    @property
    def numel(self) -> int:
        """Entries of all trained parameters."""
        return sum(row.numel for row in self.rows)

    @property
    def preconditioned_numel(self) -> int:
        """Entries of the preconditioned parameters."""
        return sum(row.numel for row in self.rows if row.preconditioned)

    @property
    def preconditioned_share(self) -> float:
        """Share of the trained parameter entries that is preconditioned."""
        return self.preconditioned_numel / max(self.numel, 1)

    @property
    def state_bytes(self) -> int:
        """Bytes of the whole optimizer state."""
        return sum(row.state_bytes for row in self.rows)

    def headline(self) -> str:
        """Return the one-line summary.

        Returns:
            E.g. `"SINGD preconditions 97.3% of 5,717,416 parameters (52 layers);
            AdamW fallback: 150 tensors; state 21.8 MiB"`.
        """
        layers = sum(row.preconditioned for row in self.rows)
        fallbacks = sorted({r.rule for r in self.rows if not r.preconditioned})
        rest = len(self.rows) - layers
        fallback = (
            f"{' and '.join(fallbacks)}: {rest} tensors" if rest else "no fallback"
        )
        plural = "" if layers == 1 else "s"
        return (
            f"{self.optimizer} preconditions {self.preconditioned_share:.1%} of "
            f"{self.numel:,} parameters ({layers} layer{plural}); {fallback}; "
            f"state {self.state_bytes / 2**20:.1f} MiB"
        )

    def __str__(self) -> str:
        """Return the headline and a table with one row per layer or parameter.

        Returns:
            Multi-line text.
        """
        header = (
            "layer / parameter",
            "rule",
            "structures (K, C)",
            "dims",
            "params",
            "state",
        )
        lines = [
            (
                r.name,
                r.rule,
                r.structures,
                r.dims,
                f"{r.numel:,}",
                _bytes(r.state_bytes),
            )
            for r in self.rows
        ]
        if any(r.skipped_steps or r.discarded_factor_updates for r in self.rows):
            header += ("skipped", "discarded")
            lines = [
                (*line, str(r.skipped_steps), str(r.discarded_factor_updates))
                for line, r in zip(lines, self.rows, strict=True)
            ]
        widths = [
            max(len(str(c)) for c in column)
            for column in zip(header, *lines, strict=True)
        ]
        text = [self.headline()]
        for line in (header, *lines):
            text.append(
                "  ".join(
                    str(c).ljust(w) for c, w in zip(line, widths, strict=True)
                ).rstrip()
            )
        return "\n".join(text)


def summarize(
    optimizer: str,
    layers: Sequence[Any],
    fallback: Sequence[tuple[Mapping[str, Any], Parameter]],
    state: Mapping[Parameter, Mapping[str, Any]],
    *,
    label: Callable[[Any], str],
    name: Callable[[Parameter], str],
) -> OptimizerSummary:
    """Return the summary of an optimizer's layers and fallback parameters.

    Args:
        optimizer: The optimizer's class name.
        layers: Its `Layer` records.
        fallback: Its fallback parameters, each with its group.
        state: Its state.
        label: Map from a layer to the name of its rule (`"SINGD"`, ...).
        name: Map from a parameter to its name in the model.

    Returns:
        The summary.
    """
    rows = []
    for layer in layers:
        tied = [site.name for site in layer.sites if site.name != layer.name]
        rows.append(
            SummaryRow(
                name=layer.name + (f" (tied: {', '.join(tied)})" if tied else ""),
                rule=label(layer),
                structures=", ".join(layer.structures),
                dims=" x ".join(str(d) for d in layer.dims),
                numel=sum(p.numel() for p in layer.params),
                state_bytes=sum(_state_bytes(state[p]) for p in layer.params),
                skipped_steps=max(_count(state, p, SKIPPED) for p in layer.params),
                discarded_factor_updates=_count(state, layer.weight, DISCARDED),
            )
        )
    for group, param in fallback:
        rule = "AdamW" if group["fallback"] == "adamw" else "SGD"
        rows.append(
            SummaryRow(
                name=name(param),
                rule=f"{rule} fallback",
                structures="",
                dims="",
                numel=param.numel(),
                state_bytes=_state_bytes(state[param]),
                skipped_steps=_count(state, param, SKIPPED),
            )
        )
    return OptimizerSummary(optimizer, tuple(rows))


def _count(
    state: Mapping[Parameter, Mapping[str, Any]], param: Parameter, key: str
) -> int:
    """Return a guard counter of a parameter's state (0 if absent).

    Args:
        state: The optimizer's state.
        param: The parameter.
        key: `"skipped_steps"` or `"discarded_factor_updates"`.

    Returns:
        The count.
    """
    return state[param].get(key, 0) if param in state else 0


def _state_bytes(state: Mapping[str, Any]) -> int:
    """Return the bytes of the tensors in one parameter's state.

    Args:
        state: The state.

    Returns:
        The bytes.
    """
    return sum(
        v.numel() * v.element_size() for v in state.values() if isinstance(v, Tensor)
    )


def _bytes(count: int) -> str:
    """Return a byte count as text.

    Args:
        count: Bytes.

    Returns:
        E.g. `"1.5 MiB"` or `"312 B"`.
    """
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"
