"""The benchmark's statistics (pure Python): t-intervals and ratios paired with the same repeat's control."""

from __future__ import annotations

import pytest

from bufreuse.bench.sweep_bench import PINNED_SHAPE, mean_ci, summarize


def test_mean_ci_t_interval() -> None:
    r = mean_ci([1.0, 2.0, 3.0])
    assert r["mean"] == 2.0 and r["n"] == 3
    assert r["hi"] - 2.0 == pytest.approx(4.303 * 1.0 / 3**0.5)
    assert mean_ci([5.0]) == {"mean": 5.0, "lo": 5.0, "hi": 5.0, "n": 1}
    with pytest.raises(ValueError):
        mean_ci([])


def _m(rep: int, config: str, step: float, reserved: int, *, comm: float = 0.5, graph: bool = False) -> dict:
    return {"repeat": rep, "config": config, "comm_ms": comm, "graph": graph, "step_ms": step,
            "max_reserved_bytes": reserved, "max_allocated_bytes": reserved - 100}  # fmt: skip


def test_summarize_pairs_by_repeat() -> None:
    ms = []
    for rep, (c, r4) in enumerate([(30.0, 30.3), (31.0, 31.31), (29.0, 29.29)]):
        ms += [_m(rep, "control", c, 5000), _m(rep, "ring4", r4, 2750), _m(rep, "ring4", r4, 2750, graph=True)]
        ms.append(_m(rep, "control", c, 5200, graph=True))
    out = summarize(ms)
    step = out["step ring4/control @comm 0.5"]
    assert step["mean"] == pytest.approx(1.01) and step["hi"] - step["lo"] < 1e-9 and step["n"] == 3
    assert out["reserved ring4/control @comm 0.5"]["mean"] == pytest.approx(0.55)
    assert out["reserved/allocated ring4 @comm 0.5"]["mean"] == pytest.approx(2750 / 2650)
    assert out["graph replay ring4/control @comm 0.5"]["mean"] == pytest.approx(1.01)
    assert "step ring2/control @comm 0.5" not in out  # never measured: no ratio, no zero


def test_pinned_shape_is_design_proxy() -> None:
    assert PINNED_SHAPE["hidden"] == 4096 and PINNED_SHAPE["tokens"] == 32768 and PINNED_SHAPE["microbatches"] == 12
