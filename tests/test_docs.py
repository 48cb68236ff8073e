"""The Python examples in the README and the documentation pages run as written.

Every ```` ```python ```` (or ```` ```{.python} ````) block of `README.md` and of
every Markdown page under `docs/pages/` (the sources of the site; the generated
gallery excluded) is executed, each in a fresh namespace. A block that cannot run
on its own — it needs `torchrun`, say — is preceded by a line

    <!-- docs-test: skip (the reason) -->

and the reason must name where the code is tested instead. The gallery scripts in
`docs/examples/` run when the site is built (`mkdocs build --strict -f
docs/mkdocs.yml`, in `.ci/run`).
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES_DIR = ROOT / "docs" / "pages"
GENERATED = PAGES_DIR / "gallery"  # written by mkdocs-gallery, git-ignored
PAGES = [
    ROOT / "README.md",
    *sorted(p for p in PAGES_DIR.rglob("*.md") if GENERATED not in p.parents),
]
# ```python, or the brace form ```{.python} that `ruff format` leaves alone (for
# pymdownx.snippets includes such as --8<-- "examples/ddp_train.py")
BLOCK = re.compile(
    r"^(?P<indent>[ \t]*)```(?:python|\{\.python\})\n(?P<code>.*?)^(?P=indent)```",
    re.DOTALL | re.M,
)
SKIP = re.compile(r"<!-- docs-test: skip \((?P<reason>[^)]*)\) -->\s*$")


def python_blocks(text: str) -> list[tuple[str, str | None]]:
    """Return `(code, skip reason or None)` for every Python block of a page."""
    blocks = []
    for match in BLOCK.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.search(before)
        indent = match.group("indent")
        code = "\n".join(
            line.removeprefix(indent) for line in match.group("code").split("\n")
        )
        blocks.append((code, skip.group("reason") if skip else None))
    return blocks


def page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_pages_are_found() -> None:
    names = {page_id(p) for p in PAGES}
    assert {"README.md", "docs/pages/index.md", "docs/pages/guide/optimizer.md"} <= (
        names
    )
    assert not any("gallery" in name for name in names)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_python_examples_run(page: Path) -> None:
    for code, skip in python_blocks(page.read_text(encoding="utf-8")):
        if skip is None:
            exec(compile(code, str(page), "exec"), {"__name__": "__docs__"})


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_skipped_blocks_say_where_they_are_tested(page: Path) -> None:
    for code, skip in python_blocks(page.read_text(encoding="utf-8")):
        if skip is not None:
            assert "test" in skip, f"{page_id(page)}: skip reason {skip!r}"
            assert code.strip(), f"{page_id(page)}: an empty skipped block"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_pages_hold_no_control_characters(page: Path) -> None:
    """A `\\beta` written through a Python string without `r` became a backspace."""
    text = page.read_bytes().decode()
    found = sorted({repr(c) for c in text if ord(c) < 32 and c != "\n"})
    assert not found, f"control characters {found} (LaTeX escapes lost?)"


def test_skip_marker_and_indented_blocks_are_recognised() -> None:
    text = (
        "x\n```python\nprint(1)\n```\n"
        "<!-- docs-test: skip (tests/x.py runs it) -->\n```python\nraise\n```\n"
        '??? example "title"\n\n    ```python\n    if True:\n        pass\n    ```\n'
        '<!-- docs-test: skip (tests/y.py) -->\n```{.python}\n--8<-- "y.py"\n```\n'
    )
    assert python_blocks(text) == [
        ("print(1)\n", None),
        ("raise\n", "tests/x.py runs it"),
        ("if True:\n    pass\n", None),
        ('--8<-- "y.py"\n', "tests/y.py"),
    ]


def test_readme_has_exactly_two_setup_commands() -> None:
    setup = (
        (ROOT / "README.md")
        .read_text(encoding="utf-8")
        .split("## Set-up on a new machine")[1]
    )
    setup = setup.split("\n## ")[0]
    commands = re.findall(r"```bash\n(.*?)```", setup, flags=re.DOTALL)
    assert len(commands) == 2
    assert "singd-curvlinops demo" in commands[0]
    assert commands[1].strip().endswith('pip install -e ".[test]" && pytest')
