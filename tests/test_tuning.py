"""The measured tuning tables: the package data loads into valid configs, the sweep
output turns into table entries, and calls look up the entry of their own kind."""
import json
import pathlib
import sys

import jax.numpy as jnp
import numpy as np

import jax_paged_attn as jpa
from jax_paged_attn import prefill, tuning

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import apply_tuning  # noqa: E402


def test_measured_tables_load_into_valid_configs():
    data = json.loads(pathlib.Path(tuning.__file__).with_name(tuning.MEASURED_TABLES_FILE).read_text())
    assert data["DECODE_TABLE"] and data["PREFILL_TABLE"]
    for entry in data["PREFILL_TABLE"]:
        head_size, dtype_name, paged = entry["key"]
        config = tuning.prefill_config(head_size, dtype_name, paged=paged)
        assert config == tuning.PrefillConfig(**entry["config"])
        prefill.check_config(config)
        assert entry["measured"]["gpu"].startswith("NVIDIA") and entry["shapes"]
    for entry in data["DECODE_TABLE"]:
        head_size, block_size, group = entry["key"]
        assert tuning.decode_config(head_size, block_size, group) == tuning.DecodeConfig(**entry["config"])


def _row(case, config, ms, key):
    return dict(suite="prefill", case=case, status="ok", ms=ms, config=config,
                table="PREFILL_TABLE", table_key=key)


def test_apply_tuning_keeps_the_best_geomean_and_untouched_keys():
    fast, slow = "PrefillConfig(block_q=128, block_k=64)", "PrefillConfig(block_q=64, block_k=64)"
    key = repr((128, "bfloat16", False))
    rows = [_row("a", fast, 1.0, key), _row("b", fast, 2.0, key),
            _row("a", slow, 1.5, key), _row("b", slow, 2.5, key)]
    existing = {"PREFILL_TABLE": [{"key": [64, "float16", True], "config": {"block_q": 16}}]}
    merged = apply_tuning.merge(existing, {"meta": {"gpu": "NVIDIA H200"}, "rows": rows})
    by_key = {tuple(e["key"]): e for e in merged["PREFILL_TABLE"]}
    assert by_key[(128, "bfloat16", False)]["config"] == {"block_q": 128, "block_k": 64}
    assert by_key[(128, "bfloat16", False)]["score"] == 1.0
    assert by_key[(64, "float16", True)]["config"] == {"block_q": 16}
    assert merged["DECODE_TABLE"] == []


def test_paged_and_packed_calls_use_their_own_table_entry(monkeypatch):
    looked_up = []
    original = tuning.prefill_config
    monkeypatch.setattr(tuning, "prefill_config",
                        lambda *a, **k: looked_up.append(k.get("paged")) or original(*a, **k))
    q = jnp.ones((20, 4, 64), jnp.float32)
    cu = jnp.array([0, 20], jnp.int32)
    packed = jnp.ones((20, 2, 64), jnp.float32)
    cache = jnp.ones((4, 16, 2, 64), jnp.float32)
    table = jnp.arange(4, dtype=jnp.int32).reshape(1, 4)
    common = dict(causal=True, implementation="triton", interpret=True)
    out_packed = jpa.flash_attn_varlen_func(q, packed, packed, cu, cu, 20, 20, **common)
    out_paged = jpa.flash_attn_varlen_func(q, cache, cache, cu, cu, 20, 20, block_table=table, **common)
    assert looked_up == [False, True]
    np.testing.assert_allclose(np.asarray(out_packed), 1.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out_paged), 1.0, rtol=1e-6)
