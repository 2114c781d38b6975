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


def layer_bench_renderable(result: dict[str, Any]) -> Group:
    """The per-arm figures, the ratio table (with the control's drift) and the notes."""
    parts: list[Any] = [_figures_table(result), _ratio_table(result)]
    notes = []
    if result["note"]:
        notes.append(result["note"])
    for arm in result["arms"][1:]:
        judged = result["summary"][arm][result["headline"]]["vs_control"]
        if judged["note"]:
            notes.append(f"{arm}: {judged['note']}")
    parts += [Text.assemble(("note: ", "yellow"), n) for n in notes]
    return Group(*parts)
