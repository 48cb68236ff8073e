"""mkdocs hooks: let mkdocs-gallery build from the repository root.

mkdocs-gallery (0.10) validates `examples_dirs` and `gallery_dirs` against the
working directory, but refuses to generate the gallery unless the working directory
is the folder of `mkdocs.yml`. `docs/mkdocs.yml` therefore names both folders
relative to the repository root, where `mkdocs build --strict -f docs/mkdocs.yml`
runs, and this hook turns them into absolute paths and enters `docs/` for the
duration of the build.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority

_START_DIR: list[str] = []


@event_priority(100)  # before the gallery plugin reads its options
def on_config(config: Any) -> None:
    """Make the gallery folders absolute and enter the config file's folder.

    Args:
        config: The mkdocs configuration.
    """
    gallery = config.plugins["gallery"].config
    for key in ("examples_dirs", "gallery_dirs"):
        gallery[key] = [Path(path).resolve() for path in gallery[key]]
    # other plugins (mkdocstrings) resolve their paths against the config file's
    # folder: name it absolutely before leaving the working directory
    config.config_file_path = str(Path(config.config_file_path).resolve())
    _START_DIR.append(os.getcwd())
    os.chdir(Path(config.config_file_path).parent)


def _leave() -> None:
    """Return to the folder the build started in."""
    if _START_DIR:
        os.chdir(_START_DIR.pop())


def on_post_build(config: Any) -> None:
    """Return to the starting folder (`mkdocs serve` rebuilds from there).

    Args:
        config: The mkdocs configuration.
    """
    _leave()


def on_build_error(error: Exception) -> None:
    """Return to the starting folder after a failed build.

    Args:
        error: The error that stopped the build.
    """
    _leave()
