#!/usr/bin/env python3
"""Turns a tuning sweep (`bench_attention.py --tune`, its tuning.json) into the measured
table the package loads: jax_paged_attn/tuned_tables.json.

    python benchmarks/apply_tuning.py OUT/tuning.json [--into jax_paged_attn/tuned_tables.json]

For each table key the config with the best geometric mean over the swept shapes that
share the key is kept (`report.best_per_table_key`) as the entry of the GPU model the sweep
ran on (its ``device_kind``: tables are per GPU model, `jax_paged_attn.tuning`); entries
of other GPU models and of keys the sweep did not cover are kept from the existing file.
The file records where the numbers come from.
"""
from __future__ import annotations

import argparse
import ast
import json
import pathlib
import sys

_BENCH_DIR = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(_BENCH_DIR))
sys.path.insert(0, str(_BENCH_DIR.parent))

import report  # noqa: E402
from jax_paged_attn import tuning  # noqa: E402

DEFAULT_TABLE_FILE = _BENCH_DIR.parent / "jax_paged_attn" / "tuned_tables.json"
TABLES = ("PREFILL_TABLE", "DECODE_TABLE")


def parse_config(text: str) -> tuple[str, dict]:
    """``"DecodeConfig(a=1, b=2)"`` -> ``("DecodeConfig", {"a": 1, "b": 2})`` (literals only)."""
    call = ast.parse(text, mode="eval").body
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
        raise ValueError(f"not a config repr: {text!r}")
    return call.func.id, {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}


def merge(existing: dict, sweep: dict) -> dict:
    rows = sweep["rows"] if isinstance(sweep, dict) else sweep
    meta = sweep.get("meta", {}) if isinstance(sweep, dict) else {}
    measured = {k: meta.get(k) for k in ("date", "gpu", "jax", "command") if k in meta}
    device = tuning.entry_device_kind({"measured": measured})

    def ident(entry: dict) -> str:
        return json.dumps([tuning.entry_device_kind(entry), entry["key"]])

    tables = {name: {ident(e): {"device": tuning.entry_device_kind(e), **e} for e in existing.get(name, [])}
              for name in TABLES}
    for (table, key_text), (config_text, score, shapes) in report.best_per_table_key(rows).items():
        _, fields = parse_config(config_text)
        entry = tuning.table_entry(device, ast.literal_eval(key_text), fields, score,
                                   [case for _, case in shapes], measured)
        tables[table][ident(entry)] = entry
    return {name: sorted(entries.values(), key=lambda e: (e["device"], e["key"]))
            for name, entries in tables.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=pathlib.Path, help="tuning.json written by bench_attention.py --tune")
    parser.add_argument("--into", type=pathlib.Path, default=DEFAULT_TABLE_FILE)
    args = parser.parse_args(argv)
    existing = json.loads(args.into.read_text()) if args.into.exists() else {}
    merged = merge(existing, json.loads(args.sweep.read_text()))
    args.into.write_text(json.dumps(merged, indent=1) + "\n")
    for name in TABLES:
        for entry in merged[name]:
            print(f"{name}[{tuple(entry['key'])}] = {entry['config']}  (score {entry.get('score')})")


if __name__ == "__main__":
    main()
