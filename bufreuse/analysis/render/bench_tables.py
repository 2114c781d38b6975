"""``bufreuse bench layer``'s result as rich tables: the figures per arm, then each arm against the control.

The numbers come from :mod:`bufreuse.bench.layer_bench` (a JSON-ready dict); this module only formats
them and imports neither torch nor megatron.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from bufreuse.analysis.render.safe import rich_text

__all__ = ["layer_bench_renderable"]

_STYLE = {"improvement": "green", "parity": "cyan", "regression": "bold red", "inconclusive": "magenta"}
_ORDER = ("host_us", "fwd_host_us", "bwd_host_us", "wall_ms", "gpu_ms")


def _num(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    return f"{value:,.1f}" if unit == "µs" else f"{value:,.3f}"


def _title(result: dict[str, Any]) -> str:
    c, env = result["config"], result["env"]
    where = env["gpu"] or f"CPU ({env['cpu']})"
    return (
        f"MoE layer: hidden {c['hidden']}, FFN {c['ffn']}, {c['experts']} experts top-{c['topk']}, "
        f"{c['tokens']} tokens, {c['spec']} spec, {c['precision']}, {c['schedule']} schedule of "
        f"{c['microbatches']} microbatches × {c['steps']} per round; {result['config']['rounds']} rounds per arm "
        f"(A B B A, {c['warmup']} warm-up dropped); {where}, torch {env['torch']}, megatron-core {env['megatron_core']}"
        + (f", TE {env['transformer_engine']}" if c["spec"] == "te" else "")
        + ("; garbage collector manual (collected before each round, off during it)" if c.get("gc") == "manual" else "")
        + (f"; C hot path {env['hotpath']}" if env.get("hotpath") else "")
        + (
            "; EP = 1: the policy arms exercise the dispatch and expert buffers as where they are used (the dispatch "
            "ring's all-to-all is then one copy the control does not make; production, the as-installed arm, uses no "
            "ring at EP = 1)"
            if c.get("dispatch_ring")
            else "; EP = 1: the policy arms exercise the expert ring as where it is used (production, the as-installed "
            "arm, uses no ring at EP × ETP = 1)"
        )
    )


def _figures_table(result: dict[str, Any]) -> Table:
    table = Table(title=rich_text(_title(result)), title_justify="left")
    table.add_column("arm")
    for key in _ORDER:
        title = result["metrics"][key]["title"] if key in result["metrics"] else "GPU ms / call (CUDA events)"
        table.add_column(f"{title}\nmedian (±½ range)", justify="right")
    for arm in result["arms"]:
        cells = []
        for key in _ORDER:
            fig = result["summary"][arm].get(key)
            if fig is None:
                cells.append("— (CPU)")
                continue
            unit = result["metrics"][key]["unit"]
            spread = f" (±{fig['spread_pct'] / 2:.1f}%)" if fig["spread_pct"] is not None else ""
            cells.append(_num(fig["median"], unit) + spread)
        table.add_row(rich_text(arm), *cells)
    return table


def _verdict(judged: dict[str, Any]) -> Text:
    return Text(judged["verdict"], style=_STYLE.get(judged["verdict"], "dim"))


def _ci(judged: dict[str, Any]) -> str:
    if judged["ci_low"] is None:
        return "—"
    return f"{judged['ci_low']:.4f} – {judged['ci_high']:.4f}"


def _ratio_table(result: dict[str, Any]) -> Table:
    band = result["band_pct"]
    table = Table(
        title=f"ratio to the control: each round over its neighbouring control round (A B B A), geometric mean, "
        f"95% t interval; unpaired: all rounds, Welch; parity band ±{band:g}%",
        title_justify="left",
    )
    for name, justify in (
        ("arm", "left"),
        ("figure", "left"),
        ("ratio", "right"),
        ("95% CI", "right"),
        ("verdict", "left"),
        ("per round", "right"),
        ("unpaired ratio, 95% CI", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    keys = [k for k in _ORDER if k in result["metrics"]]
    for arm in result["arms"][1:]:
        for key in keys:
            fig = result["summary"][arm][key]
            judged, unpaired = fig["vs_control"], fig["unpaired"]
            rr = fig["round_ratios"]
            per_round = f"median {fig['median_round_ratio']:.4f}, {min(rr):.4f} – {max(rr):.4f}"
            style = "bold" if key == result["headline"] else ""
            table.add_row(
                rich_text(arm),
                Text(result["metrics"][key]["title"], style=style),
                f"{judged['ratio']:.4f}",
                _ci(judged),
                _verdict(judged),
                per_round,
                f"{unpaired['ratio']:.4f}, {_ci(unpaired)}",
            )
    for key in keys:
        judged = result["drift"][key]
        table.add_row(
            "control drift (2nd half / 1st half)",
            result["metrics"][key]["title"],
            f"{judged['ratio']:.4f}",
            _ci(judged),
            _verdict(judged),
            f"n = {judged['n'][0]} vs {judged['n'][1]}",
            "",
        )
    return table


def _profile_table(profile: dict[str, Any]) -> Table:
    """Per arm: calls per layer call, bufreuse's share, cProfile'd wall; then the ring arms' top functions."""
    table = Table(title="Host profile per layer call (cProfile, one round per arm)", title_justify="left")
    for col in ("arm", "calls (all)", "added vs control", "bufreuse calls", "bufreuse self µs", "profiled wall µs"):
        table.add_column(col, justify="left" if col == "arm" else "right")
    for arm, p in profile["arms"].items():
        added = p.get("added_calls_per_layer_call")
        table.add_row(
            arm,
            f"{p['calls_per_layer_call']:.1f}",
            "" if added is None else f"{added:+.1f}",
            f"{p['bufreuse_calls_per_layer_call']:.1f}",
            f"{p['bufreuse_self_us_per_layer_call']:.1f}",
            f"{p['profiled_wall_us_per_layer_call']:.0f}",
        )
    return table


def _profile_top(profile: dict[str, Any]) -> list[Table]:
    tables = []
    for arm, p in profile["arms"].items():
        if arm == "control" or not p["top"]:
            continue
        table = Table(title=f"{arm}: bufreuse functions by self time per layer call", title_justify="left")
        for col in ("function", "calls", "self µs", "cumulative µs"):
            table.add_column(col, justify="left" if col == "function" else "right")
        for row in p["top"]:
            table.add_row(
                row["function"], f"{row['calls']:.2f}", f"{row['self_us']:.2f}", f"{row['cumulative_us']:.1f}"
            )
        tables.append(table)
    return tables


def _hook_time_table(hook_time: dict[str, Any]) -> Table:
    """Per hooked arm: the hooks' own host µs per layer call, the raw clock figure, entries and original calls."""
    rounds = hook_time.get("rounds", 1)
    table = Table(
        title=f"Hooks' own host time per layer call (median of {rounds} instrumented round(s) per arm)",
        title_justify="left",
    )
    cols = ("arm", "hook µs [min, max]", "raw µs (with the clock)", "empty hooks µs", "net µs [min, max]",
            "hook entries", "original calls")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col == "arm" else "right")
    for arm, h in hook_time["arms"].items():
        span = f" [{h['min_us']:.1f}, {h['max_us']:.1f}]" if "min_us" in h else ""
        net = f"{h['net_us']:.1f} [{h['net_min_us']:.1f}, {h['net_max_us']:.1f}]" if "net_us" in h else "—"
        table.add_row(
            arm,
            f"{h['us']:.1f}{span}",
            f"{h['raw_us']:.1f}",
            f"{h['stand_in_raw_us']:.1f}" if "stand_in_raw_us" in h else "—",
            net,
            f"{h['entries_per_layer_call']:.1f}",
            f"{h['originals_per_layer_call']:.1f}",
        )
    for arm, h in hook_time["arms"].items():
        for row in h.get("by_hook", []):
            table.add_row(f"  {arm}: {row['hook']}", "", f"{row['raw_us']:.1f}", "", "", f"{row['entries']:.1f}", "")
    return table


def _added_verdict(a: dict[str, Any], target: float) -> str:
    """Against the target: met when the whole interval is at or below it, not met when wholly above."""
    lo, hi = a.get("ci_low_us"), a.get("ci_high_us")
    if lo is None or hi is None:
        return "inconclusive (< 3 pairs)"
    if hi <= target:
        return f"≤ {target:g} µs: met"
    if lo > target:
        return f"≤ {target:g} µs: not met"
    return "inconclusive"


def _added_time_table(added: dict[str, Any]) -> Table:
    """Per hooked arm: host µs added per layer call over the control at the hooks' entry points, with its
    interval, from the schedules' means and from their per-call medians, and each point's share."""
    target = added.get("target_us", 10.0)
    table = Table(
        title=f"Host time added per layer call over the control ({added['pairs']} pairs of schedules, A B B A, a "
        "hooked and a plain layer swapping roles halfway, one span timer at the hooks' entry points in both)",
        title_justify="left",
    )
    for col in ("arm", "added µs", "95% CI", "verdict", "control µs at the points", "arm µs at the points"):
        table.add_column(col, justify="left" if col in ("arm", "verdict") else "right")

    def row(label: str, a: dict[str, Any]) -> None:
        ci = f"[{a['ci_low_us']:+.1f}, {a['ci_high_us']:+.1f}]" if a.get("ci_low_us") is not None else "—"
        table.add_row(label, f"{a['added_us']:+.1f}", ci, _added_verdict(a, target), f"{a['control_us']:.1f}",
                      f"{a['arm_us']:.1f}")  # fmt: skip

    for arm, a in added["arms"].items():
        if not a.get("points"):
            table.add_row(arm, "—", "—", a.get("note", ""), "—", "—")
            continue
        row(f"{arm}, mean", a)
        if a.get("per_call_median"):
            row(f"{arm}, median", a["per_call_median"])
        if a.get("halves_added_us"):  # a difference between the two layers shows here, and cancels in the mean
            first, second = a["halves_added_us"]
            table.add_row(f"  {arm}, mean by half (twin hooked / layer hooked)", f"{first:+.1f} / {second:+.1f}",
                          "", "", "", "")  # fmt: skip
    for arm, a in added["arms"].items():
        for which, rows in (("mean", a.get("points", [])), ("median", a.get("per_call_median", {}).get("points", []))):
            for p in rows:
                table.add_row(f"  {arm}, {which}: {p['point']}", f"{p['added_us']:+.1f}", "", "",
                              f"{p['control_us']:.1f}", f"{p['arm_us']:.1f}")  # fmt: skip
    return table


def layer_bench_renderable(result: dict[str, Any]) -> Group:
    """The per-arm figures, the ratio table (with the control's drift), the profile (``--profile``) and notes."""
    parts: list[Any] = [_figures_table(result), _ratio_table(result)]
    if result.get("hook_time"):
        parts.append(_hook_time_table(result["hook_time"]))
    if result.get("added_time"):
        parts.append(_added_time_table(result["added_time"]))
    if result.get("profile"):
        parts += [_profile_table(result["profile"]), *_profile_top(result["profile"])]
    notes = []
    if result["note"]:
        notes.append(result["note"])
    for arm in result["arms"][1:]:
        judged = result["summary"][arm][result["headline"]]["vs_control"]
        if judged["note"]:
            notes.append(f"{arm}: {judged['note']}")
    if result.get("hook_time"):
        notes.append(result["hook_time"]["note"])
    if result.get("added_time"):
        notes.append(result["added_time"]["note"])
    if result.get("profile"):
        notes.append(result["profile"]["note"])
    parts += [Text.assemble(("note: ", "yellow"), n) for n in notes]
    return Group(*parts)
