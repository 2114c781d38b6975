"""The median bootstrap of a long log: bounded work for a million windows, the same interval as resampling windows.

Above ``GROUPED_ABOVE`` windows a resample is drawn as counts of (value, weight) groups, so its cost is the
number of groups, not of windows: exact when the sample has at most ``MAX_GROUPS`` groups (a log prints 1-2
decimals), binned to 1/MAX_GROUPS of the middle half's width beyond that. Expected intervals come from the
window-by-window resampling (``_boot_medians``), never from the grouped code.
"""

from __future__ import annotations

import numpy as np
import pytest

import bufreuse.analysis.runs.stats as stats
from bufreuse.analysis.runs.stats import GROUPED_ABOVE, MAX_GROUPS, bootstrap_diff


class _Counting:
    """A numpy Generator that counts the values it draws (integers for windows, multinomial counts)."""

    def __init__(self, seed: int) -> None:
        self.rng, self.cells = np.random.default_rng(seed), 0

    def integers(self, *a, size, **k):
        self.cells += int(np.prod(size))
        return self.rng.integers(*a, size=size, **k)

    def multinomial(self, n, p, size):
        self.cells += int(size) * len(p)
        return self.rng.multinomial(n, p, size=size)


def _log_like(n: int, seed: int, shift: float = 0.0) -> np.ndarray:
    """Step times as a log prints them: ~6000 ms, one decimal."""
    return np.round(6000 + shift + np.random.default_rng(seed).normal(0, 20, n), 1)


def test_a_million_windows_draw_no_million_resamples_of_a_million(monkeypatch: pytest.MonkeyPatch) -> None:
    n, n_boot = 1_000_000, 2000
    base, other = _log_like(n, 1), _log_like(n, 2, shift=3.0)
    small = _log_like(GROUPED_ABOVE, 1), _log_like(GROUPED_ABOVE, 2)
    counter = _Counting(0)
    monkeypatch.setattr(stats.np.random, "default_rng", lambda seed: counter)
    lo, hi = bootstrap_diff(base, other, n_boot=n_boot)
    assert counter.cells <= 2 * n_boot * MAX_GROUPS  # window by window: 2 * n_boot * n = 4e9 draws
    assert lo < 3.0 < hi and hi - lo < 0.5  # the shift, within the interval sqrt(2 pi / 4 / n) * 20 * 4 wide
    # positive control: at GROUPED_ABOVE windows and below, resamples are drawn window by window
    counter.cells = 0
    bootstrap_diff(*small, n_boot=10)
    assert counter.cells == 2 * 10 * GROUPED_ABOVE


def _by_windows(values: np.ndarray, weights: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    """Medians of resamples drawn window by window (the path below GROUPED_ABOVE), whatever the size."""
    order = np.argsort(values, kind="stable")
    w = None if int(weights.max()) == 1 else weights[order].astype(float)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, values.size, size=(n_boot, values.size))
    return stats._boot_medians(values[order], w, order, idx)


@pytest.mark.parametrize(
    ("values", "weights", "tol"),
    [
        (_log_like(GROUPED_ABOVE + 1000, 3), np.ones(GROUPED_ABOVE + 1000, dtype=np.int64), 0.15),  # exact groups
        (_log_like(GROUPED_ABOVE + 1000, 4), np.random.default_rng(5).integers(1, 4, GROUPED_ABOVE + 1000), 0.15),
        (6000 + np.random.default_rng(6).normal(0, 20, GROUPED_ABOVE + 1000), None, 0.15),  # all distinct: binned
    ],
    ids=["one-decimal", "weighted", "distinct"],
)
def test_grouped_medians_have_the_distribution_of_window_resamples(values, weights, tol) -> None:
    w = np.ones(values.size, dtype=np.int64) if weights is None else weights
    n_boot = 400
    grouped = stats._grouped_medians(values, w, values.size, np.random.default_rng(7), n_boot)
    direct = _by_windows(values, w, n_boot, 8)
    # two independent draws of one distribution: centre and spread agree within Monte-Carlo error
    spread = float(np.std(direct))
    assert abs(float(np.mean(grouped)) - float(np.mean(direct))) < 0.3 * spread
    assert abs(float(np.std(grouped)) / spread - 1) < tol
    if weights is None:  # binned: within one bin width of the sample's own median order statistics
        _, _, _, width = stats._groups(values, w)
        assert 0 < width < float(np.subtract(*np.percentile(values, [75, 25]))) / (MAX_GROUPS - 2) * 1.01
