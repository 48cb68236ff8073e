"""The data of the comparison's workloads: everything ships with installed packages.

Nothing is downloaded. Each loader returns the same tensors on every call (and on
every machine with the same package versions):

- **digits**: scikit-learn's 1,797 handwritten 8×8 digits, split as the demo splits
  them (1,347 for training, a stratified 450 for validation).
- **Python source**: `STDLIB_MODULES`, pure-Python modules of the standard library
  that runs this interpreter, read from its installation folder. The last 10% of
  every file is validation text, the rest training text. The text depends on the
  Python version; `stdlib_corpus` returns a SHA-256 digest of it, which the results
  record.
- **stochastic block model**: a graph drawn from a fixed seed by `sbm_graph`
  (see there), with noisy class-mean node features.
- **teacher–student**: standard normal inputs labelled by a fixed random teacher
  network (`teacher`); training draws fresh inputs every step (from the run's
  seed), validation uses a fixed set (`teacher_validation`).
"""

from __future__ import annotations

import functools
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

# Pure-Python modules present in the standard library of CPython 3.10 to 3.14, in
# this order (about 250 kB of source).
STDLIB_MODULES = (
    "calendar.py",
    "contextlib.py",
    "copy.py",
    "fractions.py",
    "functools.py",
    "graphlib.py",
    "heapq.py",
    "numbers.py",
    "pprint.py",
    "queue.py",
    "shlex.py",
    "textwrap.py",
)
# newline, then the printable ASCII characters; everything else (a tab, a non-ASCII
# letter) becomes the last symbol, UNKNOWN
ALPHABET = "\n" + "".join(chr(code) for code in range(32, 127))
VOCABULARY = len(ALPHABET) + 1
VALIDATION_FRACTION = 0.1


@dataclass(frozen=True)
class Split:
    """Inputs and targets of a training and a validation set.

    Attributes:
        X_train: Training inputs.
        y_train: Training targets.
        X_val: Validation inputs.
        y_val: Validation targets.
    """

    X_train: Tensor
    y_train: Tensor
    X_val: Tensor
    y_val: Tensor


@dataclass(frozen=True)
class Corpus:
    """Character codes of the training and validation text.

    Attributes:
        train: Codes `[n_train]` (int64, values in `[0, VOCABULARY)`).
        val: Codes `[n_val]`.
        sha256: Hex digest of the UTF-8 text of all files, in order.
    """

    train: Tensor
    val: Tensor
    sha256: str


@dataclass(frozen=True)
class Graph:
    """A graph for node classification.

    Attributes:
        x: Node features `[nodes, features]`.
        edge_index: Undirected edges as both directions, `[2, edges]`.
        y: Node classes `[nodes]`.
        train_mask: Labelled nodes for training `[nodes]` (bool).
        val_mask: Nodes for validation `[nodes]` (bool).
    """

    x: Tensor
    edge_index: Tensor
    y: Tensor
    train_mask: Tensor
    val_mask: Tensor


@functools.cache
def digits() -> Split:
    """Return the digits as the demo splits them (images `[n, 1, 8, 8]` in `[0, 1]`).

    Returns:
        1,347 training and 450 validation digits.
    """
    from singd_curvlinops.demo.training import load_digits_data

    data = load_digits_data()
    return Split(data.X_train, data.y_train, data.X_test, data.y_test)


def encode(text: str) -> Tensor:
    r"""Map text to character codes (`ALPHABET` index, unknown characters last).

    Args:
        text: The text.

    Returns:
        Codes `[len(text)]`, int64.

    >>> encode("a\tb").tolist()
    [66, 96, 67]
    """
    table = {char: code for code, char in enumerate(ALPHABET)}
    return torch.tensor([table.get(char, VOCABULARY - 1) for char in text])


@functools.cache
def stdlib_corpus(folder: Path | None = None) -> Corpus:
    """Read `STDLIB_MODULES` and split every file 90/10 into training/validation.

    Args:
        folder: Where the modules are; default: this interpreter's standard library
            (`sysconfig.get_paths()["stdlib"]`).

    Returns:
        The encoded corpus.

    Raises:
        FileNotFoundError: If a module is missing (an unusual Python build).
    """
    folder = Path(folder or sysconfig.get_paths()["stdlib"])
    digest, train, val = hashlib.sha256(), [], []
    for name in STDLIB_MODULES:
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(
                f"the language-model workload reads {name} of the Python standard "
                f"library, which is not in {folder}."
            )
        text = path.read_text(encoding="utf-8")
        digest.update(text.encode("utf-8"))
        cut = int(len(text) * (1 - VALIDATION_FRACTION))
        train.append(text[:cut])
        val.append(text[cut:])
    return Corpus(encode("\n".join(train)), encode("\n".join(val)), digest.hexdigest())


@functools.cache
def sbm_graph(
    blocks: int = 4,
    block_size: int = 150,
    p_in: float = 0.05,
    p_out: float = 0.01,
    features: int = 16,
    noise: float = 1.5,
    seed: int = 0,
) -> Graph:
    r"""Draw a stochastic-block-model graph with noisy class-mean node features.

    Node \(i\) belongs to block \(c_i\) (its class); each unordered pair of nodes is
    an edge with probability `p_in` within a block and `p_out` across blocks. The
    features of node \(i\) are \(\mu_{c_i} + \sigma \varepsilon_i\) with unit-norm
    class means \(\mu_c\) and standard normal noise \(\varepsilon_i\): with the
    defaults, the features alone classify poorly and the neighbourhood helps. 10%
    of the nodes (random, from the same seed) are labelled for training, 30% are
    for validation. Everything is drawn from one `torch.Generator`, so the graph
    does not depend on the global random state or on torch_geometric.

    Args:
        blocks: Number of blocks (classes).
        block_size: Nodes per block.
        p_in: Edge probability within a block.
        p_out: Edge probability across blocks.
        features: Feature dimension.
        noise: Standard deviation \(\sigma\) of the feature noise.
        seed: Seed of the graph, features and split.

    Returns:
        The graph (with the defaults: 600 nodes, about 6,000 directed edges).
    """
    generator = torch.Generator().manual_seed(seed)
    n = blocks * block_size
    y = torch.arange(blocks).repeat_interleave(block_size)
    probability = torch.where(y[:, None] == y[None, :], p_in, p_out)
    upper = torch.rand(n, n, generator=generator).triu(1) < probability.triu(1)
    adjacency = upper | upper.T
    means = nn.functional.normalize(torch.randn(blocks, features, generator=generator))
    x = means[y] + noise * torch.randn(n, features, generator=generator)
    order = torch.randperm(n, generator=generator)
    n_train, n_val = n // 10, (3 * n) // 10
    train_mask = torch.zeros(n, dtype=torch.bool)
    val_mask = torch.zeros(n, dtype=torch.bool)
    train_mask[order[:n_train]] = True
    val_mask[order[n_train : n_train + n_val]] = True
    return Graph(x, adjacency.nonzero().T.contiguous(), y, train_mask, val_mask)


def teacher(inputs: int = 32, hidden: int = 64, outputs: int = 8) -> nn.Module:
    """Return the fixed random teacher network (seed 1234, independent of the run).

    Args:
        inputs: Input dimension.
        hidden: Width of its two hidden layers.
        outputs: Output dimension.

    Returns:
        A tanh MLP `inputs → hidden → hidden → outputs` with default initialisation.
    """
    generator = torch.Generator().manual_seed(1234)
    sizes = (inputs, hidden, hidden, outputs)
    layers: list[nn.Module] = []
    for d_in, d_out in zip(sizes[:-1], sizes[1:], strict=True):
        layer = nn.Linear(d_in, d_out)
        with torch.no_grad():
            bound = d_in**-0.5
            layer.weight.copy_(torch.rand(d_out, d_in, generator=generator) * 2 - 1)
            layer.weight.mul_(2 * bound)  # a bit larger than default: non-linear
            layer.bias.copy_((torch.rand(d_out, generator=generator) * 2 - 1) * bound)
        layers += [layer, nn.Tanh()]
    return nn.Sequential(*layers[:-1])


@functools.cache
def teacher_validation(n_val: int = 2048) -> tuple[Tensor, Tensor]:
    """Return the fixed validation set of the teacher–student workload.

    Args:
        n_val: Validation examples.

    Returns:
        Inputs `[n_val, 32]` (standard normal, seed 4321) and the teacher's outputs
        `[n_val, 8]`.
    """
    generator = torch.Generator().manual_seed(4321)
    X = torch.randn(n_val, 32, generator=generator)
    with torch.no_grad():
        return X, teacher()(X)
