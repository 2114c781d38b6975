"""One name per quantity (issue 46 item 2): the proxy control's two reserved figures keep their own names.

The control of the recorded H200 sweep has two reserved figures: **max reserved** over the steps its snapshot
traced (6,488 MiB: snapshot-report, advise, what-if, snapshot-diff, compare of snapshots) and **peak
reserved** of the whole process (7,000 MiB, ``torch.cuda.max_memory_reserved()`` in metrics.json: compare of
the sweep, the sweep table, the demo, the sweep plot). Every interface is run here on that recording; wherever
one of the two names is followed by a figure of the control, it is that name's figure, never the other's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bufreuse.cli import app

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "examples" / "sweep-h200"
CONTROL = SWEEP / "slots0" / "snapshot.pickle.gz"
TRACED, PROCESS = "6,488", "7,000"
LABELLED = re.compile(r"\b(max|peak) reserved\b[^\n\d]{0,60}?(\d{1,3}(?:,\d{3})+|\d{3,})")
AGAINST_CONTROL = re.compile(r"\b(max|peak) reserved\b[^\n]{0,80}?vs control (\d{1,3}(?:,\d{3})+|\d{3,})")


def _out(args: list[str]) -> str:
    result = CliRunner().invoke(app, args, env={"COLUMNS": "240", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    demo = tmp_path_factory.mktemp("demo") / "out"
    _out(["demo", "--examples", str(ROOT / "examples"), "--out", str(demo)])
    return {
        "snapshot-report": _out(["snapshot-report", str(CONTROL)]),
        "advise": _out(["advise", str(CONTROL)]),
        "what-if": _out(["what-if", str(CONTROL), "--slots", "4"]),
        "snapshot-diff": _out(["snapshot-diff", str(CONTROL), str(SWEEP / "slots4" / "snapshot.pickle.gz")]),
        "compare snapshots": _out(["compare", str(CONTROL), str(SWEEP / "slots4" / "snapshot.pickle.gz")]),
        "compare sweep": _out(["compare", "control", "feature", "--root", str(ROOT / "examples")]),
        **{f"demo {p.name}": p.read_text() for p in sorted(demo.rglob("*.txt"))},
    }


def _figures(text: str) -> set[tuple[str, str]]:
    return {(m.group(1), m.group(2)) for rx in (LABELLED, AGAINST_CONTROL) for m in rx.finditer(text)}


def test_no_figure_carries_the_other_quantitys_name(outputs: dict[str, str]) -> None:
    crossed = {name: f for name, text in outputs.items()
               for f in _figures(text) if f in {("max", PROCESS), ("peak", TRACED)}}  # fmt: skip
    assert not crossed, f"a reserved figure under the other quantity's name: {crossed}"


def test_each_name_shows_its_own_figure(outputs: dict[str, str]) -> None:
    """Positive control: the parse finds both figures, each under its own name, in the interfaces named above."""
    for name in ("snapshot-report", "advise", "compare snapshots"):
        assert ("max", TRACED) in _figures(outputs[name]), outputs[name]
    assert ("peak", PROCESS) in _figures(outputs["compare sweep"]), outputs["compare sweep"]
    summary = next(text for name, text in outputs.items() if name.endswith("summary.txt"))
    assert ("max", TRACED) in _figures(summary) and ("peak", PROCESS) in _figures(summary), summary


def test_the_sweep_plot_names_the_process_peak() -> None:
    from bufreuse.analysis.render.plots import plot_reserved
    from bufreuse.analysis.runs.sweep_rows import load_sweep_rows

    fig = plot_reserved(load_sweep_rows(SWEEP))
    label = fig.axes[0].get_ylabel()
    assert "peak reserved" in label and "process" in label, label
