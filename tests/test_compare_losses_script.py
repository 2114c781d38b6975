"""``scripts/compare_losses.py``: Megatron lm loss compared iteration by iteration, control vs rings."""

from __future__ import annotations

import json
from pathlib import Path

from script_module import load_script

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "docs" / "recordings" / "megatron-h200" / "h200-2026-12-02"
cl = load_script("compare_losses")


def _log(path: Path, losses: dict[int, str], *, partial: str | None = None) -> Path:
    lines = [
        f"0: [2026-12-03 10:00:00] iteration {it:>8}/      50 | elapsed time per iteration (ms): 400.0 | "
        f"lm loss: {loss} | number of skipped iterations:   0 |"
        for it, loss in losses.items()
    ]
    path.write_text("\n".join(lines) + ("\n" + partial if partial else "") + "\n")
    return path


def test_recorded_h200_runs_print_identical_losses(capsys) -> None:
    assert cl.main([str(RECORDED / "control.log"), str(RECORDED / "rings.log")]) == 0
    out = capsys.readouterr().out
    assert "9 iterations compared, 9 printed identically" in out and "AGREE" in out


def test_differing_loss_fails_and_names_the_first_iteration(tmp_path, capsys) -> None:
    a = _log(tmp_path / "a.log", {1: "1.000000E+01", 2: "9.000000E+00", 3: "8.000000E+00"})
    b = _log(tmp_path / "b.log", {1: "1.000000E+01", 2: "9.000001E+00", 3: "8.000000E+00"})
    report = tmp_path / "r.json"
    assert cl.main([str(a), str(b), "--json", str(report)]) == 1
    assert "first difference at iteration 2" in capsys.readouterr().out
    (pair,) = json.loads(report.read_text())
    assert (pair["compared"], pair["equal"], pair["first_difference"]) == (3, 2, 2)
    assert cl.main([str(a), str(b), "--tolerance", "1e-5"]) == 0


def test_missing_iteration_and_truncated_line_are_not_agreement(tmp_path) -> None:
    a = _log(tmp_path / "a.log", {1: "1.0E+01", 2: "9.0E+00"})
    b = _log(tmp_path / "b.log", {1: "1.0E+01"}, partial="iteration        2/      50 | lm loss: 9.0E+0")
    res = cl.compare_pair(a, b, 0.0)
    assert res.missing == [2] and not res.ok


def test_bad_input_exits_2(tmp_path, capsys) -> None:
    empty = tmp_path / "e.log"
    empty.write_text("no iterations here\n")
    assert cl.main([str(empty), str(empty)]) == 2
    assert cl.main([str(empty)]) == 2
    assert capsys.readouterr().err.count("compare_losses: error:") == 2
