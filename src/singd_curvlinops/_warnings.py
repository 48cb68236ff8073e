"""Warnings attributed to the user's line, however deep in the package they arise."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

# frames in these folders are skipped: the package itself and torch (whose
# `Optimizer.step` wrapper and hook machinery sit between the user and us)
_INTERNAL = (str(Path(__file__).parent), str(Path(torch.__file__).parent))


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn with the location of the first caller outside the package and torch.

    Args:
        message: The warning's text.
        category: The warning's class.
    """
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
