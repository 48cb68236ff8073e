"""Checkpoints of `SINGD`: plain `state_dict()`, bit-identical resumption, checks.

Every checkpoint goes through `torch.save` and `torch.load(..., weights_only=True)`,
as a training script would write and read it.
"""

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from singd_curvlinops import SINGD

STRUCTURES = [
    "dense",
    "diagonal",
    "block3diagonal",
    "hierarchical2_2",
    "triltoeplitz",
    "triutopleftdiag",
]
FACTOR_PREFIXES = ("K.", "C.", "m_K.", "m_C.")
MAP_LOCATIONS = ["cpu", torch.device("cpu"), lambda storage, _: storage]
if torch.cuda.is_available():
    MAP_LOCATIONS.append("cuda")  # a GPU checkpoint loaded into a CPU model


def lr_cov_schedule(step: int) -> float:
    return 0.05 / (1 + step)


# --------------------------------------------------------------------- helpers
@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    """The tensors are tiny; intra-op threads only slow a busy machine down."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_model() -> nn.Module:
    """Conv2d -> Linear -> Linear; `d_K` = 19, 49, 6 and `d_C` = 3, 5, 4."""
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(48, 5),
        nn.ReLU(),
        nn.Linear(5, 4),
    )


def make_wider_model() -> nn.Module:
    """As `make_model` (same number of parameters) but with other layer sizes."""
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64, 5),
        nn.ReLU(),
        nn.Linear(5, 4),
    )


def make_small_model() -> nn.Module:
    """One Linear layer: fewer parameters than `make_model`."""
    return nn.Sequential(nn.Flatten(), nn.Linear(32, 4))


def batches(num: int) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(8, 2, 4, 4, generator=generator),
            torch.randint(0, 4, (8,), generator=generator),
        )
        for _ in range(num)
    ]


def setup(
    seed: int = 0,
    model_fn: Callable[[], nn.Module] = make_model,
    dtype: torch.dtype = torch.float32,
    **options: Any,
) -> tuple[nn.Module, SINGD]:
    torch.manual_seed(seed)
    model = model_fn().to(dtype)
    kwargs = {
        "lr": 0.05,
        "momentum": 0.9,
        "alpha1": 0.5,
        "damping": 1e-3,
        "T": 1,
        "lr_cov": 0.05,
        "structures": ("dense", "dense"),
    }
    kwargs.update(options)
    return model, SINGD(model, **kwargs)


def train(model: nn.Module, opt: SINGD, data: list[tuple[Tensor, Tensor]]) -> None:
    dtype = next(model.parameters()).dtype
    loss_fn = nn.CrossEntropyLoss()
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x.to(dtype)).float(), y).backward()
        opt.step()


def save_load(obj: Any, path: Path, **kwargs: Any) -> Any:
    torch.save(obj, path)
    return torch.load(path, weights_only=True, **kwargs)


def assert_plain(obj: Any, where: str = "state_dict") -> None:
    """Assert that `obj` holds only tensors and plain containers/scalars/strings."""
    if isinstance(obj, Tensor):
        assert type(obj) is Tensor, f"{where}: {type(obj).__name__}, not a Tensor"
    elif type(obj) is dict:
        for key, value in obj.items():
            assert type(key) in (int, str), f"{where}: key {key!r} ({type(key)})"
            assert_plain(value, f"{where}[{key!r}]")
    elif type(obj) in (list, tuple):
        for i, value in enumerate(obj):
            assert_plain(value, f"{where}[{i}]")
    else:
        assert type(obj) in (bool, int, float, str, type(None)), (
            f"{where}: {obj!r} of type {type(obj).__name__} is not plain"
        )


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Assert bit-identical tensors (and dtypes) and equal everything else."""
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor), f"{where}: {type(b)} is not a Tensor"
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
        assert a.device == b.device, f"{where}: device {a.device} != {b.device}"
        assert torch.equal(a, b), f"{where}: tensors differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict), f"{where}: {type(b)} is not a dict"
        assert a.keys() == b.keys(), f"{where}: keys {a.keys()} != {b.keys()}"
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_run(
    model_a: nn.Module, opt_a: SINGD, model_b: nn.Module, opt_b: SINGD
) -> None:
    """Every parameter and every optimizer state tensor is bit-identical."""
    params_a, params_b = list(model_a.parameters()), list(model_b.parameters())
    assert len(params_a) == len(params_b)
    for i, (p, q) in enumerate(zip(params_a, params_b, strict=True)):
        assert_same(p.detach(), q.detach(), f"parameter {i}")
        assert_same(opt_a.state[p], opt_b.state[q], f"state of parameter {i}")
    assert len(opt_a.state) == len(opt_b.state)
    assert_same(opt_a.state_dict(), opt_b.state_dict(), "state_dict")


def resume(
    tmp_path: Path, data: list, k: int, **options: Any
) -> tuple[nn.Module, SINGD]:
    """Train `k` steps, checkpoint, resume in fresh objects, train the rest."""
    model, opt = setup(**options)
    train(model, opt, data[:k])
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    del model, opt
    checkpoint = torch.load(path, weights_only=True)
    model, opt = setup(seed=123, **options)  # other initial weights
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    train(model, opt, data[k:])
    return model, opt


def snapshot(opt: SINGD) -> tuple[dict, list]:
    options = [
        {k: v for k, v in g.items() if k != "params"} | {"params": list(g["params"])}
        for g in opt.param_groups
    ]
    return copy.deepcopy(opt.state_dict()), options


def assert_unchanged(opt: SINGD, before: tuple[dict, list]) -> None:
    state, options = before
    assert_same(state, opt.state_dict(), "state_dict after failed load")
    assert len(options) == len(opt.param_groups)
    for saved, group in zip(options, opt.param_groups, strict=True):
        assert saved.keys() == group.keys()
        for key, value in saved.items():
            if key == "params":
                assert all(p is q for p, q in zip(value, group["params"], strict=True))
            else:
                assert value is group[key] or value == group[key], key


# ------------------------------------------------------ 1. plain state_dict
@pytest.mark.parametrize("structure", STRUCTURES)
def test_state_dict_is_plain_and_loads_weights_only(
    tmp_path: Path, structure: str
) -> None:
    model, opt = setup(
        structures=(structure, "diagonal"),
        T=2,
        lr_cov=lr_cov_schedule,
        preconditioner_dtype=(torch.float64, None),
    )
    train(model, opt, batches(3))
    state_dict = opt.state_dict()
    assert_plain(state_dict)
    assert len(state_dict["state"]) == len(list(model.parameters()))
    loaded = save_load(state_dict, tmp_path / "opt.pt")
    assert_same(state_dict, loaded)
    # `state_dict()` must not change the live options it serialises
    group = opt.param_groups[0]
    assert group["lr_cov"] is lr_cov_schedule
    assert group["preconditioner_dtype"] == (torch.float64, None)
    assert group["structures"] == (structure, "diagonal")


def test_state_dict_of_fresh_optimizer_is_plain(tmp_path: Path) -> None:
    _, opt = setup(preconditioner_dtype=(torch.float32, torch.float64))
    state_dict = opt.state_dict()
    assert_plain(state_dict)
    assert_same(state_dict, save_load(state_dict, tmp_path / "opt.pt"))


def test_reference_singd_state_dict_is_not_weights_only(tmp_path: Path) -> None:
    """The motivation: singd 0.0.5 pickles its structured matrices."""
    from singd.optim.optimizer import SINGD as ReferenceSINGD

    torch.manual_seed(0)
    model = make_model()
    opt = ReferenceSINGD(model, lr=0.05, T=1)
    train(model, opt, batches(1))
    path = tmp_path / "reference.pt"
    torch.save(opt.state_dict(), path)
    with pytest.raises(Exception, match="[Ww]eights.only"):
        torch.load(path, weights_only=True)


# ------------------------------------------------------ 2. bit-identical resume
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("structure", STRUCTURES)
def test_resumed_run_is_bit_identical(tmp_path: Path, structure: str, T: int) -> None:
    data, k = batches(9), 4  # with T = 3, step 4 is in the middle of a period
    options = {"structures": (structure, structure), "T": T}
    model, opt = setup(**options)
    train(model, opt, data)
    resumed_model, resumed_opt = resume(tmp_path, data, k, **options)
    assert_same_run(model, opt, resumed_model, resumed_opt)
    weight = model[0].weight
    assert opt.state[weight]["step"] == len(data)
    assert "momentum_buffer" in opt.state[weight]


@pytest.mark.parametrize("T", [1, 3])
def test_rolling_back_an_optimizer_that_stepped_on(tmp_path: Path, T: int) -> None:
    """Loading an earlier checkpoint into the same objects continues as a resume.

    With `T = 3` the step after the checkpoint updates no factor: it must apply
    the checkpoint's factors, not products cached from the factors of later steps.
    """
    data = batches(8)
    expected_model, expected_opt = resume(tmp_path, data, 2, T=T)
    model, opt = setup(T=T)
    train(model, opt, data[:2])
    path = tmp_path / "rollback.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    train(model, opt, data[2:7])  # further on, and back
    checkpoint = torch.load(path, weights_only=True)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    train(model, opt, data[2:])
    assert_same_run(model, opt, expected_model, expected_opt)


def test_resume_without_optimizer_state_differs(tmp_path: Path) -> None:
    """The comparison above is sensitive: dropping the optimizer state shows."""
    data, k = batches(6), 3
    model, opt = setup(T=3)
    train(model, opt, data)
    first_model, first_opt = setup(T=3)
    train(first_model, first_opt, data[:k])
    checkpoint = save_load(first_model.state_dict(), tmp_path / "model.pt")
    fresh_model, fresh_opt = setup(seed=123, T=3)
    fresh_model.load_state_dict(checkpoint)
    train(fresh_model, fresh_opt, data[k:])
    assert not all(
        torch.equal(p, q)
        for p, q in zip(model.parameters(), fresh_model.parameters(), strict=True)
    )


@pytest.mark.parametrize("structure", ["dense", "triltoeplitz"])
def test_deep_copied_state_starts_an_independent_optimizer(structure: str) -> None:
    """The guide's in-memory recipe: a second optimizer from a deep copy.

    Without the copy the second optimizer keeps the first one's tensors (as
    `torch.optim` does when device and dtype match), which the test shows too, so
    that the guide's warning stays true.
    """
    data, k = batches(6), 3
    options = {"structures": (structure, structure), "T": 2}
    model, opt = setup(**options)
    train(model, opt, data)
    first_model, first_opt = setup(**options)
    train(first_model, first_opt, data[:k])
    second_model, second_opt = setup(seed=5, **options)
    second_model.load_state_dict(first_model.state_dict())
    second_opt.load_state_dict(copy.deepcopy(first_opt.state_dict()))
    train(first_model, first_opt, data[k:])
    train(second_model, second_opt, data[k:])
    assert_same_run(model, opt, first_model, first_opt)
    assert_same_run(model, opt, second_model, second_opt)

    shared_model, shared_opt = setup(seed=5, **options)
    shared_model.load_state_dict(first_model.state_dict())
    shared_opt.load_state_dict(first_opt.state_dict())
    first_weight, shared_weight = first_model[0].weight, shared_model[0].weight
    shared = shared_opt.state[shared_weight]
    state = first_opt.state[first_weight]
    tensors = {key: value for key, value in state.items() if torch.is_tensor(value)}
    factor = "K.mat" if structure == "dense" else "K.diags"
    assert {"momentum_buffer", factor} <= set(tensors)
    for key, value in tensors.items():  # factors and momenta alike
        assert shared[key].data_ptr() == value.data_ptr(), key


# ------------------------------------------------------ 3. mismatched states
@pytest.mark.parametrize(
    ("source", "match"),
    [
        ({"model_fn": make_wider_model}, "another model"),
        ({"model_fn": make_small_model}, "another model"),
        ({"structures": ("diagonal", "dense")}, "structures"),
        ({"structures": ("dense", "block3diagonal")}, "structures"),
    ],
)
def test_mismatched_state_raises_and_leaves_optimizer_usable(
    tmp_path: Path, source: dict, match: str
) -> None:
    data = batches(5)
    other_model, other_opt = setup(seed=7, **source)
    train(other_model, other_opt, data[:2])
    foreign = save_load(other_opt.state_dict(), tmp_path / "foreign.pt")

    model, opt = setup(T=2)
    twin_model, twin_opt = setup(T=2)
    train(model, opt, data[:2])
    train(twin_model, twin_opt, data[:2])
    before = snapshot(opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(foreign)
    assert_unchanged(opt, before)
    # still usable, and on exactly the trajectory it was on
    train(model, opt, data[2:])
    train(twin_model, twin_opt, data[2:])
    assert_same_run(model, opt, twin_model, twin_opt)


def test_state_of_wider_model_names_the_layer(tmp_path: Path) -> None:
    data = batches(1)
    other_model, other_opt = setup(model_fn=make_wider_model)
    train(other_model, other_opt, data)
    model, opt = setup()
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="layer '0'.*another model"):
        opt.load_state_dict(save_load(other_opt.state_dict(), tmp_path / "o.pt"))
    after = opt.state_dict()
    assert before["state"].keys() == after["state"].keys()
    for index, entries in before["state"].items():
        for key, value in entries.items():
            assert torch.equal(
                torch.as_tensor(value), torch.as_tensor(after["state"][index][key])
            )


# ------------------------------------------------------ 4. callable lr_cov
def test_callable_lr_cov_checkpoint_resumes_bit_identically(tmp_path: Path) -> None:
    data, k = batches(7), 4
    options = {
        "lr_cov": lambda step: 0.05 / (1 + step) ** 0.5,
        "T": 3,
        "structures": ("dense", "diagonal"),
    }
    model, opt = setup(**options)
    train(model, opt, data)
    resumed_model, resumed_opt = resume(tmp_path, data, k, **options)
    assert resumed_opt.param_groups[0]["lr_cov"] is options["lr_cov"]
    assert_same_run(model, opt, resumed_model, resumed_opt)


def test_callable_lambda_lr_cov_saves_and_loads_weights_only(tmp_path: Path) -> None:
    def schedule(step: int) -> float:
        return 0.02 + 0.01 * (step % 2)

    model, opt = setup(lr_cov=lambda step: 0.03 / (1 + step))
    train(model, opt, batches(2))
    loaded = save_load(opt.state_dict(), tmp_path / "opt.pt")
    assert isinstance(loaded["param_groups"][0]["lr_cov"], str)

    target_model, target_opt = setup(lr_cov=schedule)
    target_opt.load_state_dict(loaded)
    assert target_opt.param_groups[0]["lr_cov"] is schedule
    assert_same(opt.state[model[0].weight], target_opt.state[target_model[0].weight])


@pytest.mark.parametrize("lr_cov", [0.05, 0.0])
def test_callable_lr_cov_state_into_float_lr_cov_raises(
    tmp_path: Path, lr_cov: float
) -> None:
    model, opt = setup(lr_cov=lambda step: 0.05)
    train(model, opt, batches(2))
    loaded = save_load(opt.state_dict(), tmp_path / "opt.pt")
    target_model, target_opt = setup(lr_cov=lr_cov)
    train(target_model, target_opt, batches(1))
    before = snapshot(target_opt)
    with pytest.raises(ValueError, match="callable lr_cov"):
        target_opt.load_state_dict(loaded)
    assert_unchanged(target_opt, before)
    assert target_opt.param_groups[0]["lr_cov"] == lr_cov


# ------------------------------------------------------ 5. preconditioner dtype
def factor_keys(state: dict) -> list[str]:
    return [key for key in state if key.startswith(FACTOR_PREFIXES)]


@pytest.mark.parametrize("structure", ["dense", "block3diagonal", "triutopleftdiag"])
def test_float32_factors_of_bf16_model_survive_round_trip(
    tmp_path: Path, structure: str
) -> None:
    data, k = batches(6), 3
    options = {
        "dtype": torch.bfloat16,
        "preconditioner_dtype": (torch.float32, torch.float32),
        "structures": (structure, structure),
        "T": 2,
    }
    model, opt = setup(**options)
    train(model, opt, data[:k])
    saved = save_load(opt.state_dict(), tmp_path / "opt.pt")
    saved_state = saved["state"][0]  # the state of the Conv2d weight
    assert model[0].weight.dtype == torch.bfloat16
    assert len(factor_keys(saved_state)) >= 4
    assert {saved_state[k].dtype for k in factor_keys(saved_state)} == {torch.float32}

    target_model, target_opt = setup(seed=123, **options)
    target_model.load_state_dict(model.state_dict())
    target_opt.load_state_dict(saved)
    for index, layer in enumerate([target_model[0], target_model[3], target_model[5]]):
        state = target_opt.state[layer.weight]
        keys = factor_keys(state)
        assert {key.split(".")[0] for key in keys} == {"K", "C", "m_K", "m_C"}
        for key in keys:
            assert state[key].dtype == torch.float32, key
            source = opt.state_dict()["state"][2 * index][key]
            assert_same(state[key], source, key)
        for param in layer.parameters():
            buffer = target_opt.state[param]["momentum_buffer"]
            assert buffer.dtype == param.dtype == torch.bfloat16
    group = target_opt.param_groups[0]
    assert group["preconditioner_dtype"] == (torch.float32, torch.float32)

    # training continues in float32 and on the uninterrupted trajectory
    train(model, opt, data[k:])
    train(target_model, target_opt, data[k:])
    assert_same_run(model, opt, target_model, target_opt)
    state = target_opt.state[target_model[3].weight]
    assert {state[key].dtype for key in factor_keys(state)} == {torch.float32}


def test_momentum_follows_parameter_dtype_factors_keep_theirs(tmp_path: Path) -> None:
    """A float32 run resumed in bfloat16: momenta are cast, factors are not."""
    options = {"preconditioner_dtype": (torch.float32, torch.float32), "T": 2}
    model, opt = setup(**options)
    train(model, opt, batches(3))
    saved = save_load(opt.state_dict(), tmp_path / "opt.pt")
    target_model, target_opt = setup(seed=123, dtype=torch.bfloat16, **options)
    target_opt.load_state_dict(saved)
    for param, source in zip(
        target_model.parameters(), model.parameters(), strict=True
    ):
        state, source_state = target_opt.state[param], opt.state[source]
        buffer = state["momentum_buffer"]
        assert buffer.dtype == torch.bfloat16
        assert torch.equal(buffer, source_state["momentum_buffer"].bfloat16())
        for key in factor_keys(state):
            assert_same(state[key], source_state[key], key)
    train(target_model, target_opt, batches(2))
    state = target_opt.state[target_model[0].weight]
    assert {state[key].dtype for key in factor_keys(state)} == {torch.float32}
    assert state["momentum_buffer"].dtype == torch.bfloat16


@pytest.mark.parametrize("map_location", MAP_LOCATIONS)
def test_cpu_checkpoint_loads_with_map_location(
    tmp_path: Path, map_location: Any
) -> None:
    data, k = batches(5), 2
    options = {"preconditioner_dtype": (torch.float64, None), "T": 2}
    model, opt = setup(**options)
    train(model, opt, data[:k])
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    checkpoint = torch.load(path, weights_only=True, map_location=map_location)

    target_model, target_opt = setup(seed=123, **options)
    target_model.load_state_dict(checkpoint["model"])
    target_opt.load_state_dict(checkpoint["optimizer"])
    for param in target_model.parameters():
        for key, value in target_opt.state[param].items():
            if isinstance(value, Tensor):
                assert value.device == param.device, key
    weight_state = target_opt.state[target_model[0].weight]
    assert weight_state["K.mat"].dtype == torch.float64
    assert weight_state["C.mat"].dtype == torch.float32
    train(model, opt, data[k:])
    train(target_model, target_opt, data[k:])
    assert_same_run(model, opt, target_model, target_opt)
