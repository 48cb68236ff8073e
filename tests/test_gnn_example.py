"""The KarateClub gallery example runs (headless) and trains both optimizers."""

import math
import runpy
from pathlib import Path

import matplotlib

EXAMPLE = Path(__file__).parents[1] / "docs" / "examples" / "plot_gcn_karateclub.py"


def test_karateclub_example_runs() -> None:
    matplotlib.use("Agg")  # no display: the figures are drawn but not shown
    import matplotlib.pyplot as plt

    namespace = runpy.run_path(str(EXAMPLE), run_name="__main__")
    plt.close("all")
    results = namespace["results"]
    assert {name for name, _ in results} == {"AdamW", "SINGD"}
    for key, result in results.items():
        losses = result["losses"]
        assert all(math.isfinite(loss) for loss in losses), key
        assert losses[-1] < losses[0], key
    best = min(results["SINGD", lr]["losses"][-1] for lr in (0.01, 0.03, 0.1))
    assert best < 1e-3
    for lr in (0.01, 0.03, 0.1):  # far above chance (1/4) on the unlabelled nodes
        assert results["SINGD", lr]["accuracies"][-1] > 0.6
