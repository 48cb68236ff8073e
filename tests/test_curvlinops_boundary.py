"""The one module that reads curvlinops' internals checks the curvlinops version."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest
import torch
from curvlinops import FisherType, KFACLinearOperator
from torch import nn

from singd_curvlinops import SINGD, SINGDLinearOperator, _curvlinops

ROOT = Path(__file__).resolve().parents[1]


def test_supported_range_is_the_one_setup_cfg_pins() -> None:
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg", encoding="utf-8")
    requirements = setup["options"]["install_requires"].split()
    pin = next(r for r in requirements if r.startswith(_curvlinops.DISTRIBUTION))
    assert pin == _curvlinops.DISTRIBUTION + _curvlinops.SUPPORTED_VERSIONS


@pytest.mark.parametrize(
    "version, supported",
    [
        ("3.0.1", True),
        ("3.2.0.dev1", True),
        ("3.9", True),
        ("3.0.0", False),
        ("2.9.9", False),
        ("4.0.0", False),
        ("4.0.0rc1", False),
    ],
)
def test_version_check(monkeypatch, version: str, supported: bool) -> None:
    monkeypatch.setattr(_curvlinops, "installed_version", lambda: version)
    if supported:
        _curvlinops.check_version()
        return
    with pytest.raises(RuntimeError, match=r"supports versions >=3\.0\.1,<4") as info:
        _curvlinops.check_version()
    assert f"version {version} is installed" in str(info.value)


def test_internals_are_read_only_behind_the_check(monkeypatch) -> None:
    model = nn.Sequential(nn.Linear(3, 2)).double()
    optimizer = SINGD(model)
    kfac = KFACLinearOperator(
        model,
        nn.CrossEntropyLoss(),
        list(model.parameters()),
        [(torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 0, 1]))],
        fisher_type=FisherType.EMPIRICAL,
        separate_weight_and_bias=False,
        check_deterministic=False,
    )
    monkeypatch.setattr(_curvlinops, "installed_version", lambda: "4.1.0")
    with pytest.raises(RuntimeError, match="curvlinops-for-pytorch"):
        optimizer.set_curvature(kfac)
    with pytest.raises(RuntimeError, match="curvlinops-for-pytorch"):
        SINGDLinearOperator(optimizer)
    assert not optimizer.curvature_pending


def test_no_other_module_reads_curvlinops_internals() -> None:
    package = ROOT / "src" / "singd_curvlinops"
    for path in package.rglob("*.py"):
        if path.name == "_curvlinops.py":
            continue
        text = path.read_text(encoding="utf-8")
        assert "_torch_base" not in text, path
        for attribute in ("_input_covariances", "_mapping", "_separate_weight"):
            assert attribute not in text, (path, attribute)
