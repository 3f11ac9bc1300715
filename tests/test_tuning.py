"""The measured tuning tables: the package data loads into valid configs, the sweep
output turns into table entries, and calls look up the entry of their own kind."""
import dataclasses
import functools
import json
import pathlib
import sys
import warnings

import jax.numpy as jnp
import pytest
import numpy as np

import jax_paged_attn as jpa
from jax_paged_attn import plans, prefill, tuning

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import apply_tuning  # noqa: E402


def test_measured_tables_load_into_valid_configs():
    data = json.loads(pathlib.Path(tuning.__file__).with_name(tuning.MEASURED_TABLES_FILE).read_text())
    assert data["DECODE_TABLE"] and data["PREFILL_TABLE"]
    def device(entry):  # each entry is looked up on its own GPU model, whatever this host plans for
        return tuning.TuningDevice(entry["device"], tuning.REFERENCE_DEVICE.shared_memory_per_block)

    assert {entry["device"] for table in data.values() for entry in table} >= {"NVIDIA H200", "NVIDIA H100 80GB HBM3"}
    for entry in data["PREFILL_TABLE"]:
        head_size, dtype_name, paged = entry["key"]
        config = tuning.prefill_config(head_size, dtype_name, paged=paged, device=device(entry), tables=("shipped",))
        assert config == tuning.PrefillConfig(**entry["config"])
        prefill.check_config(config)
        assert entry["measured"]["gpu"].startswith(entry["device"]) and entry["shapes"]
    for entry in data["DECODE_TABLE"]:
        head_size, block_size, group = entry["key"]
        assert tuning.decode_config(head_size, block_size, group, device=device(entry), tables=("shipped",)) \
            == tuning.DecodeConfig(**entry["config"])


def test_an_unmeasured_decode_key_takes_the_nearest_measured_one_of_its_head_size():
    known = [(64, 16, 4), (128, 16, 4), (128, 16, 8), (128, 64, 4)]
    assert tuning.nearest_decode_key((64, 16, 8), known) == (64, 16, 4)  # the GQA group differs
    assert tuning.nearest_decode_key((128, 32, 8), known) == (128, 16, 8)  # page 32: 16 and 64 tie, the smaller
    assert tuning.nearest_decode_key((128, 64, 16), known) == (128, 64, 4)  # the page size first
    assert tuning.nearest_decode_key((256, 16, 4), known) is None  # no entry of that head size
    h200 = tuning.MEASURED_TABLES["NVIDIA H200"]["DECODE_TABLE"]
    assert (64, 16, 8) not in h200 and (64, 16, 4) in h200
    assert tuning.decode_config(64, 16, 8, device=tuning.REFERENCE_DEVICE) == h200[(64, 16, 4)]
    assert tuning.decode_config(256, 16, 4, device=tuning.REFERENCE_DEVICE) == tuning.DecodeConfig()


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


L4 = tuning.TuningDevice("NVIDIA L4", 99 * 1024)


def test_device_shared_memory_comes_from_the_compute_capability():
    assert tuning.device_from_properties("NVIDIA H200", "9.0").shared_memory_per_block == 227 * 1024
    assert tuning.device_from_properties("NVIDIA A100-SXM4-80GB", "8.0").shared_memory_per_block == 163 * 1024
    assert tuning.device_from_properties("NVIDIA L4", "8.9").shared_memory_per_block == 99 * 1024
    # Unknown or missing: the smallest limit among the GPUs the kernels run on.
    assert tuning.device_from_properties("future", "13.7").shared_memory_per_block == 99 * 1024
    assert tuning.device_from_properties("future", None).shared_memory_per_block == 99 * 1024
    assert tuning.REFERENCE_DEVICE.shared_memory_budget == tuning.DECODE_SHARED_MEMORY_BUDGET == 200 * 1024
    # A CPU host plans for the H200 (interpret mode, lowering for CUDA).
    assert tuning.target_device() == tuning.REFERENCE_DEVICE


def test_measured_entries_apply_only_on_their_gpu_and_an_untuned_gpu_is_said_once(monkeypatch):
    monkeypatch.setattr(tuning, "_warned_devices", set())
    measured = tuning.MEASURED_TABLES["NVIDIA H200"]["PREFILL_TABLE"]
    key = next(iter(measured))
    head_size, dtype_name, paged = key
    default = tuning.PREFILL_TABLE.get(key, tuning.PrefillConfig())
    assert measured[key] != default  # else the test shows nothing
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the H200 has its table: nothing to say
        assert tuning.prefill_config(head_size, dtype_name, paged, device=tuning.REFERENCE_DEVICE) == measured[key]
    with pytest.warns(tuning.UntunedDeviceWarning, match="NVIDIA L4.*99 KiB"):
        assert tuning.prefill_config(head_size, dtype_name, paged, device=L4) == default
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per GPU model
        tuning.decode_config(128, 16, 4, device=L4)


def _every_prefill_config():
    keys = set(tuning.PREFILL_TABLE) | {k for t in tuning.MEASURED_TABLES.values() for k in t.get("PREFILL_TABLE", {})}
    for key in sorted(keys, key=repr):
        for device in tuning.MEASURED_TABLES:
            yield key, tuning.prefill_config(*key, device=tuning.TuningDevice(device, 227 * 1024))
        yield key, tuning.PREFILL_TABLE.get(key, tuning.PrefillConfig())


def test_the_h200_tilings_fit_its_shared_memory_unchanged():
    """The shared-memory fit changes nothing on the GPU the tables were chosen on."""
    for (head_size, dtype_name, paged), config in _every_prefill_config():
        itemsize = jnp.dtype(dtype_name).itemsize
        tiling = plans.plan_prefill_tiling(32, 8, head_size, max_seqlen_q=4096, max_seqlen_k=4096, paged=paged,
                                           config=config, q_itemsize=itemsize, kv_itemsize=itemsize)
        stages = config.num_stages_paged if paged and config.num_stages_paged else config.num_stages
        assert (tiling.block_q, tiling.block_k, tiling.num_stages) == (config.block_q, config.block_k, stages)


def test_a_gpu_with_less_shared_memory_gets_a_tiling_that_fits():
    config = tuning.PrefillConfig(block_q=128, block_k=128, num_warps=8, num_stages=3)
    budget = L4.shared_memory_budget
    tiling = plans.plan_prefill_tiling(32, 8, 128, max_seqlen_q=4096, max_seqlen_k=4096, paged=False,
                                       config=config, shared_memory_budget=budget)
    assert plans.estimate_prefill_shared_memory(tiling.block_q, tiling.block_k, 128, 2, 2,
                                                tiling.num_stages) <= budget
    assert plans.estimate_prefill_shared_memory(128, 128, 128, 2, 2, 3) > budget  # it had to shrink
    assert tiling.num_stages == 2 and tiling.block_q == 128 and tiling.block_k < 128
    assert tiling.block_k % tiling.masked_block_k == 0
    decode_config = tuning.DecodeConfig(pages_per_step=16, num_stages=4, prefetch_page_ids=True)
    h200 = plans.plan_decode_tiling((8, 1, 32, 128), (100, 16, 8, 128), 64, jnp.bfloat16, jnp.bfloat16,
                                    decode_config)
    small = plans.plan_decode_tiling((8, 1, 32, 128), (100, 16, 8, 128), 64, jnp.bfloat16, jnp.bfloat16,
                                     decode_config, shared_memory_budget=budget)
    assert small.tile_keys < h200.tile_keys
    assert plans.estimate_shared_memory(small.tile_keys, 128, 2, 2, 4, True) <= budget


@pytest.mark.parametrize("paged", [False, True])
def test_kernels_planned_for_a_small_gpu_match_the_reference(monkeypatch, paged):
    """The public functions on a GPU model without a table: default configs shrunk to its
    shared memory still compute the reference's result (Pallas interpret mode)."""
    monkeypatch.setattr(tuning, "target_device", lambda: tuning.TuningDevice("small", 40 * 1024))
    monkeypatch.setattr(tuning, "_warned_devices", set())
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((40, 4, 64)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((2, 64, 16, 2, 64)), jnp.float32)
    cu_q = jnp.array([0, 15, 40], jnp.int32)
    cu_k = jnp.array([0, 30, 90], jnp.int32) if paged else cu_q
    table = jnp.arange(8, dtype=jnp.int32).reshape(2, 4) if paged else None
    k, v = (kv[0], kv[1]) if paged else (kv[0].reshape(-1, 2, 64)[:40], kv[1].reshape(-1, 2, 64)[:40])
    args = (q, k, v, cu_q, cu_k, 25, 60 if paged else 25)  # max_seqlen_q, max_seqlen_k
    with pytest.warns(tuning.UntunedDeviceWarning):
        out = jpa.flash_attn_varlen_func(*args, block_table=table, causal=True, implementation="triton",
                                         interpret=True)
    ref = jpa.flash_attn_varlen_func(*args, block_table=table, causal=True, implementation="xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)
    decode_q = jnp.asarray(rng.standard_normal((2, 1, 4, 64)), jnp.float32)
    seqlens = jnp.array([37, 64], jnp.int32)
    block_table = jnp.arange(8, dtype=jnp.int32).reshape(2, 4)
    got = jpa.flash_attn_with_kvcache(decode_q, kv[0], kv[1], seqlens, block_table, causal=True,
                                      implementation="triton", interpret=True)
    want = jpa.flash_attn_with_kvcache(decode_q, kv[0], kv[1], seqlens, block_table, causal=True,
                                       implementation="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_a_table_field_this_version_does_not_know_is_said_not_dropped_silently(tmp_path):
    path = tmp_path / tuning.MEASURED_TABLES_FILE
    path.write_text(json.dumps({"DECODE_TABLE": [
        {"device": "NVIDIA H100 80GB HBM3", "key": [128, 16, 4],
         "config": {"pages_per_step": 8, "warp_specialize": True}}]}))
    with pytest.warns(UserWarning, match=r"\[128, 16, 4\] measured on NVIDIA H100.*\['warp_specialize'\]"):
        tables = tuning.load_measured_tables(path)
    assert tables == {"NVIDIA H100 80GB HBM3": {"DECODE_TABLE": {(128, 16, 4): tuning.DecodeConfig(pages_per_step=8)}}}
    assert tuning.load_measured_tables(tmp_path / "absent.json") == {}


def test_the_tables_in_use_are_described_in_words():
    assert tuning.describe_tables(tuning.REFERENCE_DEVICE) == "tile configs measured on the NVIDIA H200"
    assert tuning.describe_tables(L4) == ("no tile configs measured on the NVIDIA L4: defaults fitted to its "
                                          "99 KiB of shared memory per block; `python3 -m jax_paged_attn.tune` "
                                          "measures a table for it")


@pytest.mark.parametrize("field, value", [
    ("block_k", 96), ("num_stages", 1), ("compute_warpgroups", 4), ("masked_block_k", 32),
    ("masked_block_k", 100), ("direct_output", 1), ("fence_softmax", None), ("persistent_programs", -1),
    ("nonfinite_check", "none"), ("value_work_tile", "shared"), ("heads_per_program", -1),
    ("heads_per_program", 2.0), ("prefetch_queries", 1), ("overlap_softmax", "yes"),
    ("pingpong_across_items", 1), ("exp2_fma_columns", 32), ("exp2_fma_columns", 64), ("exp2_fma_columns", -64),
    ("exp2_fma_columns", True)])
def test_mosaic_prefill_config_rejects_bad_fields(field, value):
    """A Mosaic GPU prefill config the kernel cannot compile is refused, naming the field."""
    config = dataclasses.replace(tuning.MosaicPrefillConfig(), **{field: value})
    with pytest.raises(ValueError, match=f"config.{field}"):
        plans.check_mosaic_prefill_config(config)


@pytest.mark.parametrize("fields, reason", [
    (dict(exp2_fma_columns=64, overlap_softmax=True), "overlap_softmax issues one P·V a block"),
    (dict(exp2_fma_columns=64), "fp8 values are converted whole"),
])
def test_split_exponentials_dropped_where_the_plan_cannot_split(fields, reason, monkeypatch):
    """``exp2_fma_columns`` off, said once, where a block's P·V is one wgmma (the
    overlapped form; fp8 values converted whole); kept otherwise."""
    monkeypatch.setattr(plans, "_dropped_fields", set())
    config = tuning.MosaicPrefillConfig(block_k=128, masked_block_k=64, **fields)
    v_itemsize = 1 if "fp8" in reason else 2
    with pytest.warns(plans.ConfigFieldDroppedWarning, match=f"exp2_fma_columns is off for this call: {reason}"):
        tiling = plans.plan_mosaic_prefill_tiling(64, 2, v_itemsize, v_itemsize, num_q_heads=8, max_seqlen_q=1024,
                                                  max_seqlen_k=1024, block_size=None, config=config,
                                                  warn_dropped=True)
    assert tiling.exp2_fma_columns == 0
    kept = plans.plan_mosaic_prefill_tiling(64, 2, 2, 2, num_q_heads=8, max_seqlen_q=1024, max_seqlen_k=1024,
                                            block_size=None, config=tuning.MosaicPrefillConfig(
                                                block_k=128, masked_block_k=64, exp2_fma_columns=64))
    assert kept.exp2_fma_columns == 64


def test_mosaic_prefill_config_takes_one_way_to_give_a_program_several_items():
    config = tuning.MosaicPrefillConfig(heads_per_program=2, persistent_programs=132)
    with pytest.raises(ValueError, match="config.heads_per_program > 1 and config.persistent_programs"):
        plans.check_mosaic_prefill_config(config)


@pytest.mark.parametrize("requested, num_q_heads, expected", [(4, 32, 4), (4, 6, 3), (4, 7, 1), (8, 4, 4), (1, 32, 1)])
def test_mosaic_prefill_heads_per_program_divide_the_query_heads(requested, num_q_heads, expected):
    """The tiling's heads per program: the largest divisor of the query heads up to the config's."""
    tiling = plans.plan_mosaic_prefill_tiling(128, 2, 2, 2, max_seqlen_q=4096, max_seqlen_k=4096, block_size=None,
                                              config=tuning.MosaicPrefillConfig(heads_per_program=requested),
                                              num_q_heads=num_q_heads)
    assert tiling.heads_per_program == expected


@pytest.mark.parametrize("head_size, hpp, persistent, specialized, expected", [
    (128, 4, 0, True, 2), (64, 4, 0, True, 2), (256, 4, 0, True, 1), (128, 1, 0, True, 1),
    (128, 0, 132, True, 2), (256, 0, 132, True, 1), (128, 0, 132, False, 1)])
def test_mosaic_prefill_prefetched_queries_take_a_second_tile_where_it_fits(head_size, hpp, persistent,
                                                                            specialized, expected, monkeypatch):
    """prefetch_queries: a second query tile per warpgroup only with a next head or item to
    load it for (several heads per program; persistent programs with a producer) and room
    beside the tiling (D 256's two warpgroups already fill shared memory); where the plan
    cannot honour it, a warning says why."""
    monkeypatch.setattr(plans, "_dropped_fields", set())
    config = dataclasses.replace(tuning.mosaic_prefill_config(head_size, "bfloat16"), heads_per_program=hpp,
                                 prefetch_queries=True, persistent_programs=persistent,
                                 warp_specialized=specialized,
                                 **({} if specialized else dict(compute_warpgroups=1)))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        tiling = plans.plan_mosaic_prefill_tiling(head_size, 2, 2, 2, max_seqlen_q=2048, max_seqlen_k=2048,
                                                  block_size=None, config=config, num_q_heads=32)
    dropped = [str(w.message) for w in said if w.category is plans.ConfigFieldDroppedWarning]
    if expected == 2:
        assert dropped == []
    elif hpp > 1 or (persistent and specialized):
        assert dropped == [f"config.prefetch_queries is off for this call: no shared memory for a second query "
                           f"tile beside {tiling.compute_warpgroups} compute warpgroups, {tiling.block_k}-key "
                           f"blocks and {tiling.num_stages} ring slots at head size {head_size}."]
    else:
        assert dropped == ["config.prefetch_queries is off for this call: a program has no next head or item to "
                           "load queries for (one head a program, not persistent with a producer)."]
    plain = plans.plan_mosaic_prefill_tiling(head_size, 2, 2, 2, max_seqlen_q=2048, max_seqlen_k=2048,
                                             block_size=None, config=dataclasses.replace(config, prefetch_queries=False),
                                             num_q_heads=32)
    assert tiling.query_buffers == expected
    assert dataclasses.replace(tiling, query_buffers=1) == plain  # the rest of the tiling is unchanged
    smem = plans.mosaic_prefill_smem_bytes(tiling.compute_warpgroups, tiling.block_k, head_size, tiling.num_stages,
                                           2, 2, 2, tiling.work_rows, query_buffers=tiling.query_buffers)
    assert smem <= tuning.MOSAIC_SHARED_MEMORY_BUDGET


@pytest.mark.parametrize("head_size", [64, 128])
def test_mosaic_prefill_package_config_prefetches_where_it_applies(head_size, monkeypatch):
    """The package's config at D 64 and 128 prefetches the next head's queries (measured
    faster on the H200, 2026-12-05): the plan takes it where a program has several heads
    (short packed sequences) and leaves it where it has one (long sequences, paged keys)
    without a warning (``warn_dropped=False``, a call without ``config``); the same config
    given by a user is warned about."""
    monkeypatch.setattr(plans, "_dropped_fields", set())
    config = tuning.mosaic_prefill_config(head_size, "bfloat16")
    assert config.prefetch_queries
    plan = functools.partial(plans.plan_mosaic_prefill_tiling, head_size, 2, 2, 2, max_seqlen_q=2048,
                             config=config, num_q_heads=32)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        short = plan(max_seqlen_k=2048, block_size=None, warn_dropped=False)
        long = plan(max_seqlen_k=16384, block_size=None, warn_dropped=False)
        paged = plan(max_seqlen_k=4096, block_size=16, warn_dropped=False)
    assert [w for w in said if w.category is plans.ConfigFieldDroppedWarning] == []
    assert (short.heads_per_program, short.query_buffers) == (4, 2)
    assert (long.heads_per_program, long.query_buffers) == (1, 1)
    assert (paged.heads_per_program, paged.query_buffers) == (1, 1)
    with pytest.warns(plans.ConfigFieldDroppedWarning, match="prefetch_queries is off .*no next head"):
        assert plan(max_seqlen_k=16384, block_size=None) == long


@pytest.mark.parametrize("hpp, persistent, workers, pingpong, max_seqlen_q, dropped", [
    (4, 0, 2, True, 2048, None), (0, 132, 2, True, 2048, None),
    (1, 0, 2, True, 2048, "a program has one work item (one head a program, not persistent)"),
    (4, 0, 2, False, 2048, "no ping-pong (it staggers two compute warpgroups)"),
    (4, 0, 3, True, 2048, "no ping-pong (it staggers two compute warpgroups)"),
    (4, 0, 2, True, 64, "no ping-pong (it staggers two compute warpgroups)")])  # (one warpgroup: 64 rows)
def test_mosaic_prefill_pingpong_across_items_needs_pingpong_and_items(hpp, persistent, workers, pingpong,
                                                                       max_seqlen_q, dropped, monkeypatch):
    """pingpong_across_items: kept with two ping-pong compute warpgroups and several work
    items a program (several heads, or persistent programs); otherwise off, said once."""
    monkeypatch.setattr(plans, "_dropped_fields", set())
    config = tuning.MosaicPrefillConfig(block_k=64, heads_per_program=hpp, persistent_programs=persistent,
                                        compute_warpgroups=workers, pingpong=pingpong, pingpong_across_items=True)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        tiling = plans.plan_mosaic_prefill_tiling(64, 2, 2, 2, max_seqlen_q=max_seqlen_q, max_seqlen_k=2048,
                                                  block_size=None, config=config, num_q_heads=32)
    said = [str(w.message) for w in said if w.category is plans.ConfigFieldDroppedWarning]
    assert tiling.pingpong_across_items == (dropped is None)
    assert said == ([] if dropped is None else [f"config.pingpong_across_items is off for this call: {dropped}."])


@pytest.mark.parametrize("max_seqlen_k, paged, persistent, expected", [
    (4096, False, 0, 4), (1, False, 0, 4), (4097, False, 0, 1), (2048, True, 0, 1), (2048, False, 132, 1)])
def test_mosaic_prefill_auto_heads_per_program(max_seqlen_k, paged, persistent, expected):
    """heads_per_program=0 (the package default): several heads per program on short packed
    sequences only."""
    config = tuning.MosaicPrefillConfig(heads_per_program=0, persistent_programs=persistent)
    assert plans.mosaic_heads_per_program(config, 32, max_seqlen_k, paged=paged) == expected
    assert plans.mosaic_heads_per_program(config, 6, max_seqlen_k, paged=paged) == min(expected, 3)
    assert tuning.mosaic_prefill_config(128, "bfloat16").heads_per_program == 0


@pytest.mark.parametrize("block_k, masked_block_k, max_seqlen_k, expected", [
    (64, 64, 4096, (64, 64)),  # the default: masked blocks whole
    (128, 64, 4096, (128, 64)),  # two 64-key parts per masked block
    (128, 128, 4096, (128, 128)),
    (192, 128, 4096, (192, 64)),  # parts divide the block
    (128, 64, 64, (64, 64)),  # block_k shrinks to the keys, and the parts with it
])
def test_mosaic_prefill_masked_parts_divide_the_block(block_k, masked_block_k, max_seqlen_k, expected):
    config = tuning.MosaicPrefillConfig(block_k=block_k, masked_block_k=masked_block_k)
    tiling = plans.plan_mosaic_prefill_tiling(64, 2, 2, 2, num_q_heads=1, max_seqlen_q=4096, max_seqlen_k=max_seqlen_k,
                                              block_size=None, config=config)
    assert (tiling.block_k, tiling.masked_block_k) == expected


@pytest.mark.parametrize("kind, head_sizes", [("NVIDIA H200", {128, 256}), ("NVIDIA H100 80GB HBM3", {128, 256}),
                                              ("NVIDIA H100 PCIe", set()), ("NVIDIA L4", set())])
def test_auto_prefills_through_the_mosaic_gpu_kernel_where_it_was_measured_faster(kind, head_sizes):
    """The H200's and the H100's measured head sizes (D 64 stays on Triton on both: the
    engine's prompt step); a GPU without a measurement keeps the Triton kernel."""
    device = tuning.TuningDevice(kind, 227 * 1024)
    assert {d for d in (32, 64, 80, 128, 192, 256) if tuning.auto_prefers_mosaic_prefill(d, device)} == head_sizes
