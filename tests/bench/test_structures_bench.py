import json

import pytest

from singd_curvlinops.bench.structures import main


def test_benchmark_reports_ours_and_reference(tmp_path, capsys):
    path = tmp_path / "records.json"
    args = ["--dims", "3,5", "--structures", "diagonal,triutopleftdiag,block2diagonal"]
    args += ["--rounds", "1", "--budget", "0.0005", "--cols", "2", "--json", str(path)]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "| structure | operation | d = 3 | d = 5 |" in table
    assert "| triutopleftdiag | `from_inner(X)` |" in table
    records = json.loads(path.read_text(encoding="utf-8"))
    assert len(records) == 3 * 2 * 10
    assert all(r["ours_s"] > 0 and r["reference_s"] > 0 for r in records)


@pytest.mark.parametrize(
    "args",
    [
        ["--structures", "nonsense"],
        ["--dims", "0"],
        ["--dims", "a"],
        ["--json", "missing-folder/records.json"],
        ["--json", "records.txt"],
    ],
)
def test_benchmark_rejects_bad_arguments(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err
