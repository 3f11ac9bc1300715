"""Turns benchmark rows into markdown: result tables, target checks, tuning tables.

Pure functions over plain dicts (the rows `bench_attention.py` writes to its JSON), so
they run without a GPU and are unit-tested on made-up rows.

A row (see `bench_attention.Row`) has at least: ``suite``, ``case`` (shape label),
``impl`` (column name), ``is_ours``, ``status`` ("ok" / "failed" / "skipped"),
``metric`` ("GB/s" or "TFLOP/s"), ``value`` (throughput), ``ms``; optionally
``ratio`` (ours / this impl, filled by `attach_ratios`), ``config``, ``note``,
``error``, ``check_max_abs_diff`` and ``check_against``. Tuning rows add
``table``, ``table_key`` and ``config``.
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any, Iterable, Sequence

Row = dict[str, Any]

OURS = "ours"
AGREEMENT_ATOL = 5e-2
"""Outputs further than this from ours (max |Δ|, bf16 data of unit variance) are flagged."""


AUTO = "auto"
"""The column of what a user's call runs (``implementation=None``)."""


@dataclasses.dataclass(frozen=True)
class Target:
    """``subject / peer >= minimum`` on every shape of ``suite`` where both ran; with no
    peer, the subject's own throughput ``>= minimum`` (GB/s or TFLOP/s). ``shapes``: only
    the shapes whose label holds this text (the target's own shapes in a suite that has
    others)."""

    suite: str
    peer: str | None
    minimum: float
    subject: str = OURS
    shapes: str = ""

    def describe(self) -> str:
        where = f"every {self.shapes} shape" if self.shapes else "every shape"
        if self.peer is None:
            return f"{self.suite}: {self.subject} >= {self.minimum:g} on {where}"
        return f"{self.suite}: {self.subject}/{self.peer} >= {self.minimum:g} on {where}"


TARGETS = (
    Target("decode", "stock_pallas", 1.6),
    Target("prefill", "stock_mha", 1.0),
    Target("prefill", "cudnn", 0.75),
    Target("decode", None, 3800.0, subject=AUTO),
    Target("prefill", "torch_sdpa_cudnn", 1.0, subject=AUTO),
    Target("varlen", "cudnn_padded", 1.5, subject=AUTO),
    # (512 new tokens on 3,584 cached at D 128, pages 16 and 64; the suite's D 64 shape
    # and its engine prompt steps are there for the head-size choice,
    # `tuning.MOSAIC_PREFILL_HEAD_SIZES`)
    Target("prefix", None, 500.0, subject=AUTO, shapes="q512 on ctx4096 Hq32 Hk8 D128"),
)

RATIO_COLUMNS: dict[str, tuple[tuple[str, str], ...]] = {
    "decode": ((AUTO, "torch_sdpa_cudnn"),),
    "prefill": ((AUTO, "torch_sdpa_cudnn"), (AUTO, "cudnn")),
    "varlen": ((AUTO, "cudnn_padded"),),
}
"""Extra columns of a suite's table, ``subject / peer`` (time ratio, > 1: subject faster):
what a user's default call gains over the strongest peers."""


# --------------------------------------------------------------------------- helpers


def format_value(x: float | None) -> str:
    """Throughputs: no decimals from 100 up, 3 significant digits below."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.3g}"


def format_ratio(x: float | None) -> str:
    return "-" if x is None else f"×{x:.2f}"


def _ordered_unique(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(values))


def _ours_row(rows: Sequence[Row], suite: str, case: str) -> Row | None:
    for row in rows:
        if row["suite"] == suite and row["case"] == case and row.get("is_ours") and row["status"] == "ok":
            return row
    return None


def _measured(rows: Sequence[Row], suite: str, case: str, impl: str) -> Row | None:
    """The row of ``impl`` on ``case`` when it measured something (ours: `_ours_row`)."""
    if impl == OURS:
        return _ours_row(rows, suite, case)
    for row in rows:
        if row["suite"] == suite and row["case"] == case and row["impl"] == impl:
            return row if row["status"] == "ok" and row.get("value") else None
    return None


def pair_ratio(rows: Sequence[Row], suite: str, case: str, subject: str, peer: str) -> float | None:
    """``subject``'s throughput over ``peer``'s on one shape (= peer's time / subject's), or None."""
    a, b = _measured(rows, suite, case, subject), _measured(rows, suite, case, peer)
    return None if a is None or b is None else a["value"] / b["value"]


def attach_ratios(rows: list[Row]) -> list[Row]:
    """Sets ``ratio`` = ours' throughput / the row's throughput (= the row's time / ours).

    Every impl of a shape is credited with the same useful work, so the ratio is a time
    ratio; > 1 means ours is faster. Rows without a successful ours get ``None``.
    """
    for row in rows:
        row["ratio"] = None
        if row.get("is_ours") or row["status"] != "ok" or not row.get("value"):
            continue
        ours = _ours_row(rows, row["suite"], row["case"])
        if ours is not None and ours.get("value"):
            row["ratio"] = ours["value"] / row["value"]
    return rows


# --------------------------------------------------------------------------- result tables


def _cell(row: Row | None, footnotes: dict[str, int], reason_chars: int) -> str:
    """``value (×ratio)`` for a measured cell; ``status [n]`` with footnote n otherwise
    (cells failing for the same reason share the footnote)."""
    if row is None:
        return "-"
    if row["status"] == "ok":
        text = format_value(row["value"])
        if not row.get("is_ours") and row.get("ratio") is not None:
            text += f" ({format_ratio(row['ratio'])})"
        diff = row.get("check_max_abs_diff")
        if diff is not None and not (diff <= AGREEMENT_ATOL):  # NaN counts as disagreement
            text += " ≠"
        return text
    reason = " ".join((row.get("error") or row["status"]).replace("|", "/").split())[:reason_chars]
    note = f"{row['impl']}: {row['status']}: {reason}"
    number = footnotes.setdefault(note, len(footnotes) + 1)
    return f"{row['status']} [{number}]"


def render_suite(suite: str, rows: Sequence[Row], title: str, legend: dict[str, str],
                 compact: bool = False) -> list[str]:
    """Markdown for one suite: throughput table with ratios, then (unless ``compact``)
    the column legend and per-row details (configs, notes, output checks), then the
    reasons of failed / skipped cells."""
    rows = [r for r in rows if r["suite"] == suite]
    if not rows:
        return []
    metric = rows[0]["metric"]
    cases = _ordered_unique(r["case"] for r in rows)
    impls = _ordered_unique([OURS] + [r["impl"] for r in rows])
    by_key = {(r["case"], r["impl"]): r for r in rows}
    footnotes: dict[str, int] = {}
    lines = [f"### {suite}: {title}", ""]
    if not compact:
        lines += [f"{metric}, higher is better; `(×r)` = ours / that column (r > 1: ours faster); "
                  f"`≠` = max |output - reference| > {AGREEMENT_ATOL:g}, the reference being ours "
                  f"(attention) or the expected cache contents (cache writes).", ""]
    pairs = [(a, b) for a, b in RATIO_COLUMNS.get(suite, ()) if a in impls and b in impls]
    header = impls + [f"{a} / {b}" for a, b in pairs]
    lines.append("| shape | " + " | ".join(header) + " |")
    lines.append("| --- |" + " --- |" * len(header))
    for case in cases:
        cells = [_cell(by_key.get((case, impl)), footnotes, 160 if compact else 400) for impl in impls]
        cells += [format_ratio(pair_ratio(rows, suite, case, a, b)) for a, b in pairs]
        ours = by_key.get((case, OURS))
        label = case if ours is None or ours.get("ms") is None else f"{case} ({ours['ms']:.3f} ms)"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    if not compact:
        legend_lines = [f"- `{impl}`: {legend[impl]}" for impl in impls if impl in legend]
        if legend_lines:
            lines += ["Columns:", *legend_lines, ""]
        details = []
        for row in rows:
            bits = []
            if row.get("config"):
                bits.append(f"config {row['config']}")
            if row.get("note"):
                bits.append(row["note"])
            if row.get("check_max_abs_diff") is not None:
                bits.append(f"max |out - {row.get('check_against', OURS)}| = {row['check_max_abs_diff']:.3g}")
            if bits and row["status"] == "ok":
                details.append(f"- {row['impl']} on {row['case']}: " + "; ".join(bits))
        if details:
            lines += ["Details:", *details, ""]
    if footnotes:
        lines += ["Not measured:", *[f"{number}. {note}" for note, number in footnotes.items()], ""]
    return lines


def render_summary(rows: Sequence[Row], suites: Sequence[tuple[str, str]]) -> str:
    """Short text for a terminal: compact tables, then the targets (the last lines)."""
    lines = []
    for suite, title in suites:
        lines += render_suite(suite, rows, title, {}, compact=True)
    lines += ["Targets:", *[f"  {t}" for t in target_lines(rows)]]
    return "\n".join(lines)


def target_lines(rows: Sequence[Row], targets: Sequence[Target] = TARGETS) -> list[str]:
    """One line per target: PASS / FAIL / NOT MEASURED, with the worst shape."""
    lines = []
    for target in targets:
        cases = _ordered_unique(r["case"] for r in rows if r["suite"] == target.suite and target.shapes in r["case"])
        if not cases:
            continue
        scores: dict[str, float] = {}
        missing: list[str] = []
        for case in cases:
            subject = _measured(rows, target.suite, case, target.subject)
            if subject is None:
                missing.append(f"{case} ({target.subject} did not run)")
                continue
            if target.peer is None:
                scores[case] = subject["value"]
                continue
            ratio = pair_ratio(rows, target.suite, case, target.subject, target.peer)
            if ratio is None:
                missing.append(f"{case} ({target.peer} did not run)")
            else:
                scores[case] = ratio
        show = format_value if target.peer is None else format_ratio
        if scores:
            worst_case = min(scores, key=scores.get)
            verdict = "PASS" if all(r >= target.minimum for r in scores.values()) else "FAIL"
            failing = [f"{c} {show(r)}" for c, r in scores.items() if r < target.minimum]
            text = (f"{verdict} {target.describe()}: min {show(scores[worst_case])} at "
                    f"{worst_case} ({len(scores)} shapes)")
            if failing:
                text += "; below: " + ", ".join(failing)
        else:
            text = f"NOT MEASURED {target.describe()}"
        if missing:
            text += "; n/a: " + ", ".join(missing)
        lines.append(text)
    return lines


def render_header(meta: dict[str, Any], heading: str) -> list[str]:
    lines = [f"# {heading}", ""]
    for key in ("date", "gpu", "jax", "jaxlib", "torch", "python", "command", "elapsed_s", "budget_s"):
        if key in meta:
            value = meta[key]
            lines.append(f"- {key}: `{value}`" if key == "command" else f"- {key}: {value}")
    for note in meta.get("notes", []):
        lines.append(f"- note: {note}")
    return lines + [""]


def render_results(meta: dict[str, Any], rows: Sequence[Row], suites: Sequence[tuple[str, str]],
                   legends: dict[str, dict[str, str]]) -> str:
    """The whole RESULTS.md: header, target summary, one section per suite."""
    lines = render_header(meta, "jax_paged_attn benchmark results")
    targets = target_lines(rows)
    if targets:
        lines += ["## Targets", "", *[f"- {t}" for t in targets], ""]
    lines += ["## Results", ""]
    for suite, title in suites:
        lines += render_suite(suite, rows, title, legends.get(suite, {}))
    return "\n".join(lines).rstrip() + "\n"


# --------------------------------------------------------------------------- tuning


def best_per_case(rows: Sequence[Row]) -> dict[tuple[str, str], Row]:
    """Fastest successful tuning row per (suite, case)."""
    best: dict[tuple[str, str], Row] = {}
    for row in rows:
        if row["status"] != "ok":
            continue
        key = (row["suite"], row["case"])
        if key not in best or row["ms"] < best[key]["ms"]:
            best[key] = row
    return best


def best_per_table_key(rows: Sequence[Row]) -> dict[tuple[str, str], tuple[str, float, list]]:
    """For each (table, table_key): the config with the best geometric mean, over the
    shapes sharing that key, of (that shape's best time / the config's time).

    Only configs that ran on every such shape compete. Returns
    ``{(table, key): (config, score in (0, 1], [(suite, case), ...])}``.
    """
    from jax_paged_attn import tune  # (the package's tuner makes the same choice)

    times: dict[tuple[str, str], dict[str, dict[tuple[str, str], float]]] = defaultdict(lambda: defaultdict(dict))
    for row in rows:
        if row["status"] == "ok":
            times[(row["table"], row["table_key"])][row["config"]][(row["suite"], row["case"])] = row["ms"]
    return tune.choose(times)


def tuning_literals(rows: Sequence[Row]) -> str:
    """Python dict literals, one per tuning table, ready to paste into jax_paged_attn/tuning.py."""
    chosen = best_per_table_key(rows)
    out = []
    for table in _ordered_unique(r["table"] for r in rows if r.get("table")):
        entries = sorted((key, value) for (t, key), value in chosen.items() if t == table)
        out.append(f"{table} = {{")
        for key, (config, score, shapes) in entries:
            out.append(f"    {key}: {config},  # {score:.3f} of per-shape best (geomean), "
                       f"{len(shapes)} shape(s)")
        out.append("}")
    per_shape = best_per_case(rows)
    out.append("")
    out.append("# best config per shape (ms)")
    out.append("BEST_PER_SHAPE = {")
    for (suite, case), row in per_shape.items():
        out.append(f"    {(suite, case)!r}: {row['config']},  # {row['ms']:.4f} ms")
    out.append("}")
    return "\n".join(out)


def render_tuning(meta: dict[str, Any], rows: Sequence[Row]) -> str:
    """The whole TUNING.md: per-shape default vs best, then the table literals."""
    lines = render_header(meta, "jax_paged_attn kernel tuning")
    best = best_per_case(rows)
    lines += ["`table` = the config the current tuning table gives the shape (what the benchmark runs).", "",
              "| suite | shape | configs ok / run / planned | table ms | best ms | gain | best config |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for suite, case in _ordered_unique((r["suite"], r["case"]) for r in rows):
        planned = [r for r in rows if r["suite"] == suite and r["case"] == case]
        ran = [r for r in planned if r["status"] != "skipped"]
        ok = [r for r in ran if r["status"] == "ok"]
        current = next((r for r in ok if r.get("is_default_config")), None)
        top = best.get((suite, case))
        current_ms = f"{current['ms']:.4f}" if current else "-"
        if top:
            gain = current["ms"] / top["ms"] if current else None
            best_cells = f"{top['ms']:.4f} | {format_ratio(gain)} | `{top['config']}`"
        else:
            best_cells = "- | - | -"
        lines.append(f"| {suite} | {case} | {len(ok)} / {len(ran)} / {len(planned)} | {current_ms} | {best_cells} |")
    failures = [r for r in rows if r["status"] == "failed"]
    lines += ["", f"Failed configs: {len(failures)}"]
    for row in failures[:40]:
        lines.append(f"- {row['case']} {row['config']}: {(row.get('error') or '')[:200]}")
    lines += ["", "```python", tuning_literals(rows), "```", ""]
    return "\n".join(lines)
