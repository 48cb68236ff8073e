"""Which modules the built-in adapters take: those that keep their function."""

from __future__ import annotations

from torch.nn import Module


def plain_forward(
    module: Module, base: type[Module], equivalent: frozenset[str] = frozenset()
) -> bool:
    """Return whether `module` computes its `torch.nn` base class's function.

    A subclass that overrides `forward` may compute anything from its parameters
    (timm's `Conv2dSame` pads its input first, Hugging Face's positional
    embeddings compute their own indices, Gemma's scaled embedding multiplies
    the lookup): the statistics of the base class would be wrong for it, so the
    built-in adapters leave it to the fallback rule (`register_layer` takes it).

    Args:
        module: A module that is an instance of `base`.
        base: The `torch.nn` class whose function the adapter knows.
        equivalent: Qualified names of subclasses whose `forward` is known to
            compute the same function.

    Returns:
        True if its class keeps `base.forward`, or is one of `equivalent`.
    """
    cls = type(module)
    return cls.forward is base.forward or (
        f"{cls.__module__}.{cls.__qualname__}" in equivalent
    )
