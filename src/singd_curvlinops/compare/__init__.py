"""`singd-curvlinops compare`: tuned, resumable optimizer comparisons on Optuna.

A study trains every workload with every optimizer at the first quasi-random points
of the optimizer's search space, each with several seeds, and reports the time to
a validation target, performance profiles and, with `--bf16`, which bfloat16 runs
diverge or degrade against float32. One module per job:

- `data`: the data sets, all shipped with installed packages (no download);
- `models`: the networks (every parameter in a layer that SINGD preconditions);
- `workloads`: model + data + loss + validation metric, target and budget;
- `search`: search spaces and their quasi-random (Halton) points;
- `optimizers`: the optimizer registry (`FAMILIES`) and the shared schedule;
- `trial`: one run, timed without evaluation;
- `study`: the Optuna engine (storage, resume, several workers);
- `summary`: chosen trials, performance profiles, bfloat16 against float32;
- `report`, `figures`: Markdown, JSON and PNG output;
- `command`: the command line.

The engine and the Shampoo-family baseline are the optional extra `compare`;
`require_compare` names what is missing.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from singd_curvlinops.demo import MissingExtraError

# importable module -> package of the `compare` extra that provides it
EXTRA_PACKAGES = {
    "optuna": "optuna",
    "matplotlib": "matplotlib",
    "tqdm": "tqdm",
    "sklearn": "scikit-learn",
    "torch_geometric": "torch_geometric",
    "pytorch_optimizer": "pytorch-optimizer",
}
ALWAYS_NEEDED = ("optuna", "matplotlib", "tqdm")


def require_compare(modules: Iterable[str] = ()) -> None:
    """Check that the `compare` extra's packages for a study are installed.

    Args:
        modules: Modules that the chosen workloads and optimizers need, in
            addition to `ALWAYS_NEEDED` (the engine, figures and progress bars).

    Raises:
        MissingExtraError: Naming the missing packages and the command that
            installs them.
    """
    missing = []
    for module in dict.fromkeys([*ALWAYS_NEEDED, *modules]):
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(EXTRA_PACKAGES.get(module, module))
    if missing:
        raise MissingExtraError(
            f"compare needs {', '.join(missing)} from the `compare` extra; "
            'install it with: pip install "singd-curvlinops[compare]"'
        )
