"""The Python examples in the README and the docs run as written."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(path: Path) -> list[str]:
    return re.findall(
        r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.DOTALL
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_examples_run(page: Path) -> None:
    for block in python_blocks(page):
        if "MyStructure" in block:  # a template for the reader's own class
            continue
        exec(compile(block, str(page), "exec"), {})


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
