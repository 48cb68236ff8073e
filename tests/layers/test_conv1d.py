"""Hugging Face `Conv1D`: a transposed linear layer, recognised without an import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from singd_curvlinops import KFAC, SINGD
from singd_curvlinops.layers import adapter_for
from singd_curvlinops.layers.conv1d import Conv1DAdapter


def _pair():
    torch.manual_seed(0)
    conv = nn.Sequential(Conv1D(8, 6), nn.Tanh(), Conv1D(3, 8)).double()
    linear = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    with torch.no_grad():
        for c, lin in zip(conv[::2], linear[::2], strict=True):
            lin.weight.copy_(c.weight.T)
            lin.bias.copy_(c.bias)
    return conv, linear


@pytest.mark.parametrize(
    ("cls", "options"),
    [(SINGD, {}), (SINGD, {"structures": ("triltoeplitz", "diagonal")}), (KFAC, {})],
)
def test_conv1d_trains_as_the_transposed_linear_layer(cls, options) -> None:
    conv, linear = _pair()
    assert isinstance(adapter_for(conv[0]), Conv1DAdapter)
    optimizers = [cls(net, lr=0.1, T=1, **options) for net in (conv, linear)]
    assert [layer.dims for layer in optimizers[0].layers] == [(7, 8), (9, 3)]
    X, y = torch.randn(4, 5, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    for _ in range(4):
        for net, optimizer in zip((conv, linear), optimizers, strict=True):
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(X).mean(1), y).backward()
            optimizer.step()
    # the same numbers up to round-off: the two layers' gradient matrices have
    # transposed layouts, which dense factors multiply by different BLAS paths
    # (`structures.dense`), and KFAC's inverses amplify the difference (1.5e-12)
    for c, lin in zip(conv[::2], linear[::2], strict=True):
        torch.testing.assert_close(c.weight.T, lin.weight, rtol=0, atol=1e-11)
        torch.testing.assert_close(c.bias, lin.bias, rtol=0, atol=1e-11)


def test_conv1d_is_recognised_without_importing_transformers() -> None:
    script = (
        "import sys; sys.modules['transformers'] = None\n"
        "import torch\n"
        "from singd_curvlinops import SINGD\n"
        "from singd_curvlinops.layers.conv1d import is_conv1d\n"
        "class Conv1D(torch.nn.Module):  # a look-alike of another package\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.weight = torch.nn.Parameter(torch.zeros(3, 2))\n"
        "assert not is_conv1d(Conv1D())\n"
        "model = torch.nn.Linear(3, 2)\n"
        "SINGD(model, T=1)\n"
        "assert sys.modules['transformers'] is None\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
