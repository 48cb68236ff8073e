r"""Structure names, as users write them, mapped to structure classes.

Fixed names map to one class each; two families take sizes in the name:
`block{B}diagonal` (e.g. `block30diagonal`) and `hierarchical{K1}_{K2}`
(e.g. `hierarchical15_15`). Sizes are written in ASCII digits without leading
zeros, so that every structure has one name, and lie in `[1, MAX_SIZE]` (`B`) or
`[0, MAX_SIZE]` (`K1`, `K2`), `MAX_SIZE` \(= 2^{31} - 1\); other sizes are
rejected here, by the name check, not later by an overflow inside torch. Users add
their own classes with `register_structure`.
"""

from __future__ import annotations

import re

from singd_curvlinops.structures._checks import MAX_SIZE
from singd_curvlinops.structures.base import StructuredMatrix
from singd_curvlinops.structures.block_diagonal import block_diagonal
from singd_curvlinops.structures.dense import DenseMatrix
from singd_curvlinops.structures.diagonal import DiagonalMatrix
from singd_curvlinops.structures.hierarchical import hierarchical
from singd_curvlinops.structures.toeplitz import TrilToeplitzMatrix, TriuToeplitzMatrix
from singd_curvlinops.structures.triangular import (
    TrilBottomRightDiagonalMatrix,
    TrilTopLeftDiagonalMatrix,
    TriuBottomRightDiagonalMatrix,
    TriuTopLeftDiagonalMatrix,
)

# [0-9], not \d: int() would also read other scripts' digits, such as "٣"
_BLOCK_PATTERN = re.compile(r"block([0-9]+)diagonal")
_HIERARCHICAL_PATTERN = re.compile(r"hierarchical([0-9]+)_([0-9]+)")
_FAMILY_NAMES = ("block{B}diagonal", "hierarchical{K1}_{K2}")

_BUILTIN: dict[str, type[StructuredMatrix]] = {
    "dense": DenseMatrix,
    "diagonal": DiagonalMatrix,
    "triltoeplitz": TrilToeplitzMatrix,
    "triutoeplitz": TriuToeplitzMatrix,
    "trilbottomrightdiag": TrilBottomRightDiagonalMatrix,
    "triltopleftdiag": TrilTopLeftDiagonalMatrix,
    "triubottomrightdiag": TriuBottomRightDiagonalMatrix,
    "triutopleftdiag": TriuTopLeftDiagonalMatrix,
}
_USER: dict[str, type[StructuredMatrix]] = {}


def structure_names() -> list[str]:
    """Return every accepted name; families appear with their size placeholders.

    Returns:
        Sorted fixed names, then the two families, then user-registered names.
    """
    return sorted(_BUILTIN) + list(_FAMILY_NAMES) + sorted(_USER)


def get_structure(name: str) -> type[StructuredMatrix]:
    """Return the structure class called `name`.

    Args:
        name: A fixed name such as `"dense"`, a family member such as
            `"block30diagonal"` or `"hierarchical15_15"`, or a registered name.

    Returns:
        The structured matrix class.

    Raises:
        TypeError: If `name` is not a string.
        ValueError: If `name` is unknown or a family size is invalid; the message
            lists the valid names.

    Examples:
        >>> get_structure("block3diagonal").eye(4).to_dense().diagonal()
        tensor([1., 1., 1., 1.])
    """
    if not isinstance(name, str):
        raise TypeError(f"A structure name must be a str, got {type(name).__name__}.")
    if name in _BUILTIN:
        return _BUILTIN[name]
    if name in _USER:
        return _USER[name]
    problems = []
    if match := _BLOCK_PATTERN.fullmatch(name):
        problems = _size_problems(match, ("B",), 1)
        if not problems:
            return block_diagonal(int(match.group(1)))
    elif match := _HIERARCHICAL_PATTERN.fullmatch(name):
        problems = _size_problems(match, ("K1", "K2"), 0)
        if not problems:
            return hierarchical(int(match.group(1)), int(match.group(2)))
    shown = name if len(name) <= 60 else f"{name[:40]}...{name[-15:]}"
    raise ValueError(
        f"Unknown structure {shown!r}. Valid names: {', '.join(structure_names())} "
        f"(B in [1, {MAX_SIZE}], K1, K2 in [0, {MAX_SIZE}], without leading zeros)"
        + "".join(f"; {problem}" for problem in problems)
        + "."
    )


def _size_problems(match: re.Match, symbols: tuple[str, ...], low: int) -> list[str]:
    """Say what is wrong with the sizes in a family name (`"0"` in `block0diagonal`).

    Args:
        match: The match of the family's pattern; group `i + 1` holds size `i`.
        symbols: The sizes' symbols, e.g. `("K1", "K2")`.
        low: Smallest allowed size.

    Returns:
        One message per invalid size (leading zeros, outside `[low, MAX_SIZE]`).
    """
    problems = []
    for symbol, digits in zip(symbols, match.groups(), strict=True):
        too_long = len(digits) > len(str(MAX_SIZE))  # int() of 5000 digits raises
        if len(digits) > 1 and digits.startswith("0"):
            problems.append(f"write {symbol} without leading zeros")
        elif too_long or not low <= int(digits) <= MAX_SIZE:
            got = f"{len(digits)} digits" if too_long else digits
            problems.append(f"{symbol} must be in [{low}, {MAX_SIZE}], got {got}")
    return problems


def register_structure(name: str, cls: type[StructuredMatrix]) -> None:
    """Make `cls` available under `name` (for `get_structure` and the optimizers).

    Args:
        name: New name; must not be taken by a built-in, a family or another
            registration.
        cls: A subclass of `StructuredMatrix`.

    Raises:
        TypeError: If `name` is not a string or `cls` is not a `StructuredMatrix`
            subclass.
        ValueError: If `name` is empty or already taken.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}.")
    if not (isinstance(cls, type) and issubclass(cls, StructuredMatrix)):
        raise TypeError(f"cls must be a StructuredMatrix subclass, got {cls!r}.")
    family = _BLOCK_PATTERN.fullmatch(name) or _HIERARCHICAL_PATTERN.fullmatch(name)
    if name in _BUILTIN or name in _USER or family:
        owner = _USER.get(name) or _BUILTIN.get(name)
        taken_by = owner.__name__ if owner else "a built-in structure family"
        raise ValueError(f"Structure name {name!r} is already taken by {taken_by}.")
    _USER[name] = cls


def unregister_structure(name: str) -> None:
    """Remove a structure registered with `register_structure`.

    Args:
        name: The registered name.

    Raises:
        ValueError: If `name` was not registered by a user.
    """
    if name not in _USER:
        raise ValueError(
            f"{name!r} is not a user-registered structure; registered: {sorted(_USER)}."
        )
    del _USER[name]
