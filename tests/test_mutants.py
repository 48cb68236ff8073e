"""`.ci/mutations/mutants.json` stays applicable as the code changes.

Running the mutants takes about six minutes and is done by hand
(`.ci/mutations/README.md`); this checks in milliseconds that every mutant still
names one exact place in its file and existing tests, so that a change of the
code that moves a mutant's text fails here instead of going unnoticed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = json.loads((ROOT / ".ci" / "mutations" / "mutants.json").read_text())


def test_mutant_ids_are_unique_and_entries_complete() -> None:
    ids = [mutant["id"] for mutant in MUTANTS]
    assert len(ids) == len(set(ids)) and len(ids) >= 60
    for mutant in MUTANTS:
        assert {"id", "file", "old", "new", "tests"} <= mutant.keys(), mutant["id"]
        assert set(mutant) <= {"id", "file", "old", "new", "tests", "equivalent"}
        assert mutant["old"] != mutant["new"], mutant["id"]


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m["id"] for m in MUTANTS])
def test_mutant_names_one_place_and_existing_tests(mutant: dict) -> None:
    source = (ROOT / mutant["file"]).read_text()
    assert source.count(mutant["old"]) == 1, "the mutant's text moved: update it"
    for argument in mutant["tests"].split():
        assert (ROOT / argument.split("::")[0]).exists(), argument
