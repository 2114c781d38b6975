"""The README's headline figures, recomputed from the bundled H200 recordings.

The snapshots are read with bufreuse's restricted unpickler (never ``pickle.load``), but every figure is
derived here from the raw trace events and torch's own counters (``metrics.json``), not from the report
code, so a bug in the report cannot confirm itself:

- "a 4-slot ring reserves 0.45-0.52x the memory of the record_stream control": 0.45 is the fresh-process
  sweep (``examples/sweep-h200``: torch's ``max_memory_reserved`` of slots4 / slots0), 0.52 the mean of the
  per-repeat ratios at 0.5 ms communication in ``docs/benchmarks-proxy.json``.
- "at unchanged step time": ring-4's median step within 1% of the control's (the throughput band).
- "the control's 4,864 MiB pending-free queue at the max-active point drops to 0": a walk over the trace.
- "what-if predicts ring-2/4/10's max reserved exactly": the prediction from the control's trace equals
  torch's counter of each ring run.

And every figure the README quotes in its text and tables (not in the pasted command outputs, which
tests/test_readme_commands.py checks against the commands) appears in docs/benchmarks.md, where its command,
date and machine are.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import Counter
from pathlib import Path

import pytest

from bufreuse.analysis.snapshot import report_file
from bufreuse.analysis.snapshot.unpickle import load_pickle_file
from bufreuse.analysis.snapshot.whatif import what_if

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
SWEEP = ROOT / "examples" / "sweep-h200"
README = (ROOT / "README.md").read_text()
BENCHMARKS = (ROOT / "docs" / "benchmarks.md").read_text()
# A quoted figure: an interval in brackets, a pair "216 → 532 MiB", or a number with a unit, %, or ×.
_FIGURE = re.compile(
    r"\[[^\]]*\d[^\]]*\]"
    r"|\d[\d,]*(?:\.\d+)?\s?→\s?\d[\d,]*(?:\.\d+)?\s?(?:MiB|GiB|µs|ms|%)"
    r"|[+−-]?\d[\d,]*(?:\.\d+)?(?:[–-]\d[\d,]*(?:\.\d+)?)?\s?(?:%|×|MiB|GiB|µs|ms)"
)


def quoted_figures(markdown: str) -> list[str]:
    """Figures in a Markdown text outside fenced blocks and HTML comments, bold markers dropped."""
    text = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S).replace("**", "")
    return _FIGURE.findall(text)


def missing_from_benchmarks(markdown: str, benchmarks: str = BENCHMARKS) -> list[str]:
    flat = " ".join(benchmarks.replace("**", "").split())
    return [f for f in quoted_figures(markdown) if " ".join(f.split()) not in flat]


def _metrics(config: str) -> dict:
    return json.loads((SWEEP / config / "metrics.json").read_text())


def _site(event: dict) -> str:
    """The proxy's allocation site: the first frame in bench/schedule.py (``line:function``)."""
    for f in event.get("frames") or []:
        if f["filename"].endswith("bench/schedule.py"):
            return f"{f['line']}:{f['name']}"
    return "?"


def _pending_at_max_active(path: Path) -> tuple[int, int, Counter]:
    """Walk the trace: ``(max active, pending-free bytes there, pending bytes by site)``.

    Active = allocated + pending-free (freed by the program, not yet reusable because of recorded stream
    uses): ``alloc`` adds to allocated, ``free_requested`` moves a block to pending, ``free_completed``
    ends it. Blocks alive when recording began are counted from their first event (a first
    ``free_requested`` means allocated at start, a first ``free_completed`` pending at start) and from the
    final segment list (blocks without any event keep their final state throughout). The first event at
    which active reaches its maximum is the max-active point.
    """
    raw = load_pickle_file(path)
    (events,) = raw["device_traces"]
    block_events = [e for e in events if e["action"] in ("alloc", "free_requested", "free_completed")]
    first: dict[int, dict] = {}
    for e in block_events:
        first.setdefault(e["addr"], e)
    allocated = sum(e["size"] for e in first.values() if e["action"] == "free_requested")
    pending_blocks = {a: e["size"] for a, e in first.items() if e["action"] == "free_completed"}
    for seg in raw["segments"]:
        addr = seg["address"]
        for b in seg["blocks"]:
            if addr not in first:
                if b["state"] == "active_allocated":
                    allocated += b["size"]
                elif b["state"] == "active_pending_free":
                    pending_blocks[addr] = b["size"]
            addr += b["size"]
    sites: dict[int, str] = {}
    best_active, best_pending = -1, Counter()
    for e in block_events:
        a, size = e["addr"], e["size"]
        if e["action"] == "alloc":
            allocated += size
            sites[a] = _site(e)
        elif e["action"] == "free_requested":
            allocated -= size
            pending_blocks[a] = size
        else:
            pending_blocks.pop(a, None)
        active = allocated + sum(pending_blocks.values())
        if active > best_active:
            best_active = active
            best_pending = Counter()
            for addr, s in pending_blocks.items():
                best_pending[sites.get(addr, "?")] += s
    return best_active, sum(best_pending.values()), best_pending


def test_readme_states_the_figures_this_file_checks() -> None:
    assert "**0.45–0.52×**" in README
    assert "4,864 MiB pending-free" in README
    assert "predicts ring-2/4/10's max reserved exactly" in README


def test_ring4_reserves_045_of_the_control_in_fresh_processes() -> None:
    # torch.cuda.max_memory_reserved() of each fresh process: 3,160 MiB / 7,000 MiB.
    ring, control = _metrics("slots4")["max_reserved_bytes"], _metrics("slots0")["max_reserved_bytes"]
    assert (ring / MiB, control / MiB) == (3160, 7000)
    assert round(ring / control, 2) == 0.45


def test_ring4_reserves_052_of_the_control_on_the_repeated_proxy() -> None:
    # Each repeat's ring-4 max reserved over the same repeat's control (0.5 ms comm, eager), mean of the 5.
    data = json.loads((ROOT / "docs" / "benchmarks-proxy.json").read_text())
    by = {}
    for m in data["measurements"]:
        if m["comm_ms"] == 0.5 and not m["graph"] and m["config"] in ("control", "ring4"):
            by[m["config"], m["repeat"]] = m["max_reserved_bytes"]
    repeats = sorted({r for _, r in by})
    ratios = [by["ring4", r] / by["control", r] for r in repeats]
    assert len(ratios) == 5
    assert round(statistics.fmean(ratios), 2) == 0.52


def test_ring4_step_time_is_within_the_one_percent_band_of_the_control() -> None:
    # The median of the 20 recorded steps (the values, not the stored summary): 45.14 vs 45.32 ms.
    ring = statistics.median(_metrics("slots4")["step_ms"]["values"])
    control = statistics.median(_metrics("slots0")["step_ms"]["values"])
    assert len(_metrics("slots4")["step_ms"]["values"]) == 20
    assert abs(ring / control - 1) <= 0.01


def test_control_pending_free_at_max_active_is_4864_mib_and_ring4_has_none() -> None:
    active, pending, by_site = _pending_at_max_active(SWEEP / "slots0" / "snapshot.pickle.gz")
    assert pending == 4864 * MiB
    # docs/benchmarks.md: 2,304 MiB dispatch output + 2,560 MiB expert output.
    assert {k: v // MiB for k, v in by_site.items()} == {"89:dispatch": 2304, "102:expert_fc2_output": 2560}
    assert active > pending > 0  # control: the probe sees a queue when there is one
    ring_active, ring_pending, _ = _pending_at_max_active(SWEEP / "slots4" / "snapshot.pickle.gz")
    assert ring_active > 0 and ring_pending == 0
    # The figure the sweep recorded on the GPU (the report code, at run time) agrees with the walk.
    assert _metrics("slots0")["pending_free_at_max_active_bytes"] == pending
    assert _metrics("slots4")["pending_free_at_max_active_bytes"] == 0
    # ... and so does today's snapshot-report on the same files (the walk is the reference for it).
    for config, walked_active, walked_pending in (("slots0", active, pending), ("slots4", ring_active, 0)):
        rep = report_file(SWEEP / config / "snapshot.pickle.gz")
        assert (rep["max_active_bytes"], rep["pending_free_at_max_active_bytes"]) == (walked_active, walked_pending)


@pytest.mark.parametrize("slots", [2, 4, 10])
def test_what_if_predicts_each_ring_runs_max_reserved_exactly(slots: int) -> None:
    report = what_if(SWEEP / "slots0" / "snapshot.pickle.gz", [slots])
    pred = next(p for p in report.predictions if p.slots == slots)
    assert pred.max_reserved == _metrics(f"slots{slots}")["max_reserved_bytes"]


def test_readme_headline_numbers_are_the_recomputed_ones() -> None:
    nums = re.search(r"peak reserved \*\*([0-9.]+)–([0-9.]+)×\*\*", README)  # one name: the process peak
    assert nums is not None
    assert (float(nums.group(1)), float(nums.group(2))) == (0.45, 0.52)


def test_every_figure_the_readme_quotes_is_in_docs_benchmarks() -> None:
    figures = quoted_figures(README)
    assert len(figures) >= 15  # the headline table is read (a parse that finds nothing would pass vacuously)
    assert {"0.45–0.52×", "+0.09%", "[−0.79%, +0.98%]", "40 µs", "216 → 532 MiB"} <= set(figures)
    assert missing_from_benchmarks(README) == []


def test_a_figure_only_the_readme_has_is_reported() -> None:
    text = "Rings reserve **0.45–0.52×**; eager +0.17% [−0.45%, +0.79%]; 3,333 MiB.\n```text\n9,999 MiB\n```\n"
    assert quoted_figures(text) == ["0.45–0.52×", "+0.17%", "[−0.45%, +0.79%]", "3,333 MiB"]
    assert missing_from_benchmarks(text) == ["3,333 MiB"]  # the fenced output is not a quoted figure
