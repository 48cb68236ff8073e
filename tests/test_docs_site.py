"""Consistency of the documentation site's sources, checked without building it.

The strict build (`mkdocs build --strict -f docs/mkdocs.yml`, run by `.ci/run`
after the tests) is the real check; these tests catch the same mistakes in the
sources quickly and without the `docs` extra: a page missing from the navigation, a
navigation entry without a page, a broken relative link in a README, a gallery
script without a title, and a `docs` extra that lacks part of the toolchain.
"""

import ast
import configparser
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOCS = ROOT / "docs"
PAGES_DIR = DOCS / "pages"
CONFIG = (DOCS / "mkdocs.yml").read_text(encoding="utf-8")
BUILD_COMMAND = "mkdocs build --strict -f docs/mkdocs.yml"


def nav_entries() -> list[str]:
    """Return the Markdown files named in the `nav` section of mkdocs.yml."""
    nav = CONFIG.split("\nnav:\n", 1)[1]
    return re.findall(r"^\s*- (?:[^:\n]+: )?(\S+\.md)\s*$", nav, flags=re.M)


def source_pages() -> list[str]:
    """Return the hand-written pages (the gallery's are generated at build time)."""
    return sorted(
        p.relative_to(PAGES_DIR).as_posix()
        for p in PAGES_DIR.rglob("*.md")
        if (PAGES_DIR / "gallery") not in p.parents
    )


def test_every_page_is_in_the_nav_and_every_nav_entry_exists() -> None:
    entries = nav_entries()
    assert "index.md" in entries and len(entries) >= 20
    assert sorted(entries) == source_pages()
    assert "\n  - Gallery: gallery\n" in CONFIG


@pytest.mark.parametrize(
    "readme",
    ["README.md", "notebooks/README.md", "docs/examples/README.md"],
)
def test_relative_links_of_readmes_resolve(readme: str) -> None:
    path = ROOT / readme
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text("utf-8"))
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    missing = [link for link in local if not (path.parent / link).exists()]
    assert not missing, f"{readme} links to missing files: {missing}"


def test_gallery_scripts_have_markdown_titles() -> None:
    scripts = sorted((DOCS / "examples").glob("plot_*.py"))
    assert len(scripts) >= 6
    for script in scripts:
        docstring = ast.get_docstring(ast.parse(script.read_text("utf-8")))
        assert docstring and re.match(r"# \S", docstring), script.name


def test_docs_extra_has_the_toolchain_the_config_uses() -> None:
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg", encoding="utf-8")
    extra = setup["options.extras_require"]["docs"]
    names = {re.split(r"[\[<>=]", line.strip())[0] for line in extra.split("\n")}
    block = re.split(r"\n(?=\S)", CONFIG.split("\nplugins:\n", 1)[1], maxsplit=1)[0]
    plugins = re.findall(r"^  - (\w+)", block, flags=re.M)
    assert plugins == ["search", "gallery", "mkdocstrings"]
    needs = {"search": "mkdocs", "gallery": "mkdocs-gallery"}
    for plugin in plugins:
        assert needs.get(plugin, plugin) in names, plugin
    # the theme, the math extension, and what the gallery scripts import
    assert {"mkdocs-material", "pymdown-extensions", "matplotlib", "scikit-learn"} <= (
        names
    )


def test_build_command_is_documented_and_run_in_ci() -> None:
    assert BUILD_COMMAND in (ROOT / "README.md").read_text("utf-8")
    assert BUILD_COMMAND in (ROOT / ".ci" / "run").read_text("utf-8")
    assert BUILD_COMMAND in CONFIG


def test_snippet_includes_are_intact_and_name_existing_files() -> None:
    """`--8<-- "path"` lines (pymdownx.snippets, paths relative to docs/).

    A formatter that treats an include as Python rewrites it to `--8 < --"path"`,
    which the site then shows as text; only the canonical form includes the file.
    """
    includes = []
    for page in PAGES_DIR.rglob("*.md"):
        for line in page.read_text("utf-8").splitlines():
            if re.search(r"-+\s*8\s*<\s*-+", line):
                match = re.fullmatch(r'\s*--8<-- "([^"]+)"', line)
                assert match, f"{page.name}: mangled include {line.strip()!r}"
                includes.append(match.group(1))
    assert "examples/ddp_train.py" in includes
    for path in includes:
        assert (DOCS / path).is_file(), path
