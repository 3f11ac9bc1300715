"""CPU smoke test of benchmarks/bench_attention.py, so the GPU harness does not rot.

Checks the work arithmetic (bytes, causal FLOPs) against brute force, the input
layouts every peer derives from, the report (ratios, target lines, tuning literals),
the crash-resume logic of the per-suite processes, a tiny dry run of our
implementations (implementation="xla") through the whole harness, the refusal to run
without a GPU, where the outputs go and the exit code when nothing was measured; and
the other scripts' CPU runs (tiny model): the engine benchmarks (`bench_engine.py`'s
table and its one-jit dense loop's tokens against the engine's, `bench_tp.py`'s tp=1 / tp=2
table on forced CPU devices, `bench_serving.py`'s rate sweep, arrival loop and cold / warm
start-up), the parts and profile scripts.

No test depends on wall-clock time: dry runs pass ``--budget-s inf`` and deadlines are
infinite, except where a test shifts the clock itself; the benchmarks' timings are
checked for being measured, never for their values.
"""
from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import itertools
import json
import math
import pathlib
import statistics
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from jax_paged_attn import reference
from jax_paged_attn.spec import AttentionSpec

_BENCH_DIR = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, _BENCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bench = _load("bench_attention")
# The harness's modules, imported by bench_attention from the same folder.
report, suites, timing, sweeps, suite_jobs = (sys.modules[name] for name in ("report", "suites", "timing", "sweeps",
                                                                             "jobs"))
parts_common = _load("parts_common")


# --------------------------------------------------------------------------- arithmetic


def test_decode_bytes_and_dense_flops_follow_the_documented_counts():
    # README: 2 * B * ctx * Hk * D * 2 bytes; 4 * B * Hq * D * S^2 / 2 flops (flash-attention's count).
    assert suites.decode_kv_bytes(64, 4096, 8, 128, 2) == 2 * 64 * 4096 * 8 * 128 * 2
    assert suites.DecodeCase(64, 4096, 32, 8, 128).work == 2**30
    assert suites.dense_causal_flops(8, 2048, 32, 128) == 4 * 8 * 32 * 128 * 2048**2 / 2
    assert suites.PREFILL_CASES[0].work == suites.dense_causal_flops(8, 2048, 32, 128)


@pytest.mark.parametrize("q_len,k_len", [(1, 1), (7, 7), (5, 12), (12, 5), (3, 0), (0, 4), (1, 300), (64, 64)])
def test_causal_visible_pairs_counts_the_bottom_right_mask(q_len, k_len):
    spec = AttentionSpec.create(8, causal=True)
    # key_visible is elementwise: on NumPy arrays it runs in NumPy (no compile).
    visible = reference.key_visible(np.arange(q_len)[:, None], np.arange(k_len)[None, :], q_len, k_len, spec)
    assert suites.causal_visible_pairs(q_len, k_len) == int(np.sum(visible))


def test_varlen_and_prefix_work_is_exact_causal_work():
    lens = (5, 40, 17)
    case = suites.AttentionCase("mixed", lens, lens, 4, 2, 32)
    assert case.work == 4 * 4 * 32 * sum(n * (n + 1) // 2 for n in lens)
    prefix = suites.PREFIX_CASES[0]  # 8 x (512 new on 4096 keys)
    new, keys = 512, 4096
    assert prefix.work == 4 * 32 * 128 * 8 * (new * (keys - new) + new * (new + 1) // 2)
    mixed = suites.VARLEN_CASES[0]
    assert len(mixed.q_lens) == 16 and all(64 <= n <= 4096 for n in mixed.q_lens)
    assert 24_000 < sum(mixed.q_lens) < 42_000  # "about 32k tokens"


def test_cache_bytes_count_reads_writes_and_slots():
    bf16, fp8 = suites.CACHE_CASES[1], suites.CACHE_CASES[2]
    rows = 2 * 16 * 2048 * 8 * 128
    assert bf16.work == rows * (2 + 2) + 4 * 16 * 2048
    assert fp8.work == rows * (2 + 1) + 4 * 16 * 2048 and fp8.cache_dtype == "float8_e4m3fn"


def test_throughput_units():
    assert suite_jobs.throughput(2e9, 1.0, "GB/s") == pytest.approx(2000.0)
    assert suite_jobs.throughput(3e12, 10.0, "TFLOP/s") == pytest.approx(300.0)


def test_stock_paged_grid_only_has_configs_the_stock_kernel_accepts():
    for pages in (64, 256, 512, 2048, 4):
        grid = sweeps.stock_paged_grid(pages, quick=False)
        assert grid and len(set(grid)) == len(grid)
        for splits, per_block in grid:
            assert pages % splits == 0 and (pages // splits) % per_block == 0


# --------------------------------------------------------------------------- input layouts


def test_decode_inputs_use_a_permuted_block_table_and_a_consistent_contiguous_view():
    case = suites.TINY_CASES["decode"][0]
    x = suites.build_decode_inputs(case)
    table = np.asarray(x.block_table)
    assert sorted(table.reshape(-1).tolist()) == list(range(x.k_cache.shape[0]))
    k = timing.to_numpy(x.contiguous(x.k_cache, case.context))
    cache = timing.to_numpy(x.k_cache)
    b, j = 1, 37
    np.testing.assert_array_equal(k[b, j], cache[table[b, j // case.page_size], j % case.page_size])


def test_a_ragged_decode_batch_reads_each_sequence_own_context():
    case = suites.DecodeCase.ragged((9, 64, 30), 4, 2, 32)
    assert (case.batch, case.context, case.label) == (3, 64, "ragged B3 ctx9-64 (mean 34) Hq4 Hk2 D32 page16")
    assert case.work == suites.decode_kv_bytes(1, 9 + 64 + 30, 2, 32, 2)
    assert np.asarray(suites.build_decode_inputs(case).seqlens).tolist() == [9, 64, 30]
    with pytest.raises(ValueError, match="contexts"):
        suites.DecodeCase(2, 64, 4, 2, 32, contexts=(9, 64, 30))


def test_attention_inputs_paged_keys_and_padding_round_trip():
    case = suites.TINY_CASES["prefix"][0]
    x = suites.build_attention_inputs(case)
    keys, _ = x.keys_values()
    assert keys.shape[0] == sum(case.k_lens)
    table, cache = np.asarray(x.block_table), timing.to_numpy(x.k)
    b, j = 1, 33  # sequence 1 starts after sequence 0's keys
    row = case.k_lens[0] + j
    np.testing.assert_array_equal(timing.to_numpy(keys)[row],
                                  cache[table[b, j // case.page_size], j % case.page_size])
    padded_q = x.padded_q()
    np.testing.assert_array_equal(x.unpad(padded_q), timing.to_numpy(x.q))


def test_cache_inputs_write_distinct_slots_in_range():
    case = suites.CACHE_CASES[0]  # 256 sequences writing one token each
    x = suites.build_cache_inputs(case)
    slots = np.asarray(x.slot_mapping)
    assert slots.shape == (case.tokens,) and len(set(slots.tolist())) == case.tokens
    assert slots.min() >= 0 and slots.max() < case.num_blocks * case.page_size


# --------------------------------------------------------------------------- report


def _row(suite, case, impl, value, status="ok", **extra):
    row = dict(suite=suite, case=case, impl=impl, is_ours=impl == "ours", metric="GB/s", status=status,
               value=value, ms=None if value is None else 1000.0 / value)
    row.update(extra)
    return row


def test_report_ratios_targets_and_failures():
    rows = [
        _row("decode", "A", "ours", 3000.0), _row("decode", "A", "stock_pallas", 1500.0),
        _row("decode", "B", "ours", 2000.0), _row("decode", "B", "stock_pallas", 1600.0, check_max_abs_diff=0.3),
        _row("prefill", "P", "ours", 400.0), _row("prefill", "P", "cudnn", 500.0),
        _row("prefill", "P", "stock_mha", None, status="failed", error="D=256 unsupported"),
    ]
    report.attach_ratios(rows)
    assert rows[1]["ratio"] == pytest.approx(2.0) and rows[3]["ratio"] == pytest.approx(1.25)
    lines = report.target_lines(rows)
    assert lines[0].startswith("FAIL decode") and "B ×1.25" in lines[0]
    assert lines[1].startswith("NOT MEASURED prefill: ours/stock_mha") and "stock_mha did not run" in lines[1]
    assert lines[2].startswith("PASS prefill: ours/cudnn >= 0.75")
    text = "\n".join(report.render_suite("decode", rows, "t", {"ours": "our kernel"}))
    assert "| A (0.333 ms) | 3000 | 1500 (×2.00) |" in text
    assert "1600 (×1.25) ≠" in text  # output differs from ours
    prefill = "\n".join(report.render_suite("prefill", rows, "t", {}))
    assert "failed [1]" in prefill and "1. stock_mha: failed: D=256 unsupported" in prefill
    summary = report.render_summary(rows, [("decode", "t"), ("prefill", "t")])
    assert any(line.startswith("  PASS prefill: ours/cudnn >= 0.75") for line in summary.splitlines())
    assert "Columns:" not in summary


def test_report_auto_column_ratio_columns_and_absolute_targets():
    rows = [
        _row("decode", "A", "ours", 3000.0), _row("decode", "A", "auto", 3900.0),
        _row("decode", "A", "torch_sdpa_cudnn", 3000.0),
        _row("decode", "B", "ours", 3000.0), _row("decode", "B", "auto", 3500.0),
        _row("prefill", "P", "ours", 400.0), _row("prefill", "P", "auto", 600.0),
        _row("prefill", "P", "torch_sdpa_cudnn", 500.0), _row("prefill", "P", "cudnn", None, status="failed",
                                                             error="no cuDNN"),
        _row("prefix", "prefix: B8 q512 on ctx4096 Hq32 Hk8 D128 page16", "auto", 510.0),
        _row("prefix", "prefix: B8 q512 on ctx4096 Hq32 Hk8 D64 page16", "auto", 330.0),
        _row("prefix", "prompts: B8 q8218 k8218 Hq32 Hk8 D128 page16", "auto", 217.0),
    ]
    report.attach_ratios(rows)
    decode = "\n".join(report.render_suite("decode", rows, "t", {}))
    assert "| shape | ours | auto | torch_sdpa_cudnn | auto / torch_sdpa_cudnn |" in decode
    assert "| A (0.333 ms) | 3000 | 3900 (×0.77) | 3000 (×1.00) | ×1.30 |" in decode
    assert decode.count("| B (0.333 ms) |") == 1 and "| - |" in decode  # B has no torch row: no ratio
    prefill = "\n".join(report.render_suite("prefill", rows, "t", {}))
    assert "auto / torch_sdpa_cudnn | auto / cudnn |" in prefill and "| ×1.20 | - |" in prefill
    lines = report.target_lines(rows)
    assert "FAIL decode: auto >= 3800 on every shape: min 3500 at B (2 shapes); below: B 3500" in lines
    assert "PASS prefill: auto/torch_sdpa_cudnn >= 1 on every shape: min ×1.20 at P (1 shapes)" in lines
    # The prefix target holds for its cached-prefix D 128 shapes; the suite's D 64 shape and
    # its engine prompt steps are not judged by it.
    assert ("PASS prefix: auto >= 500 on every q512 on ctx4096 Hq32 Hk8 D128 shape: min 510 at "
            "prefix: B8 q512 on ctx4096 Hq32 Hk8 D128 page16 (1 shapes)") in lines


def test_tuning_literal_picks_the_best_geomean_config_per_table_key():
    def tune_row(case, config, ms, key="(128, 16, 4)"):
        return dict(suite="decode", case=case, impl="ours", status="ok", ms=ms, config=config,
                    table="DECODE_TABLE", table_key=key, is_default_config=config == "A()")

    rows = [tune_row("s1", "A()", 1.0), tune_row("s1", "B()", 1.1), tune_row("s2", "A()", 3.0),
            tune_row("s2", "B()", 2.0), tune_row("s3", "C()", 1.0, key="(128, 16, 8)")]
    chosen = report.best_per_table_key(rows)
    # A: sqrt(1 * 2/3) = 0.816; B: sqrt(1/1.1 * 1) = 0.953
    assert chosen[("DECODE_TABLE", "(128, 16, 4)")][0] == "B()"
    literal = report.tuning_literals(rows)
    assert "    (128, 16, 4): B(),  # 0.953" in literal and "    (128, 16, 8): C()," in literal
    assert "| decode | s2 | 2 / 2 / 2 | 3.0000 | 2.0000 | ×1.50 | `B()` |" in report.render_tuning({}, rows)


# --------------------------------------------------------------------------- per-suite processes


def test_isolated_suite_records_a_crashed_job_and_resumes_after_it(tmp_path):
    args = bench.parse_args(["--tiny", "--suite", "cache", "--peers", "xla_scatter,jax_elementwise"])
    jobs = bench.plan_jobs("cache", args)
    assert [j.impl.name for j in jobs] == ["ours", "xla_scatter", "jax_elementwise"]
    starts = []

    def fake_spawn(command, timeout_s):
        start = int(command[command.index("--child-start") + 1])
        rows_path = pathlib.Path(command[command.index("--child-rows") + 1])
        starts.append(start)
        done = jobs[start:start + 1] if start == 0 else jobs[start:]  # the first process dies after one row
        rows_path.write_text("".join(json.dumps(dataclasses.asdict(j.blank_row())) + "\n" for j in done))
        return -11 if start == 0 else 0

    rows, _ = suite_jobs.run_suite_isolated("cache", jobs, args, timing.Deadline(math.inf), tmp_path, spawn_fn=fake_spawn)
    assert starts == [0, 2]
    assert [(r["impl"], r["status"]) for r in rows] == [("ours", "ok"), ("xla_scatter", "failed"),
                                                         ("jax_elementwise", "ok")]
    assert "process ended during this job (exit code -11)" in rows[1]["error"]


def test_a_childs_later_line_replaces_the_row_it_names(tmp_path):
    """After the alternating rounds a suite's process writes re-timed rows again, each
    naming the row it replaces; the parent keeps one row a job, the latest."""
    path = tmp_path / "rows.jsonl"
    first = [dict(impl="ours", ms=2.0), dict(impl="peer", ms=3.0)]
    lines = [*first, dict(impl="peer", ms=2.5, **{suite_jobs.REPLACES: 1})]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"cut sh')
    assert suite_jobs._read_rows(path) == [dict(impl="ours", ms=2.0), dict(impl="peer", ms=2.5)]


def test_rounds_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--tiny", "--rounds", "0"])
    assert "--rounds must be at least 1" in capsys.readouterr().err


# --------------------------------------------------------------------------- dry run


def test_dry_run_of_our_implementations_through_the_harness(tmp_path):
    argv = ["--tiny", "--no-isolate", "--ours-impl", "xla", "--peers", "xla_gather,xla_scatter",
            "--reps", "1", "--warmup", "1", "--out", str(tmp_path), "--stem", "run", "--budget-s", "inf"]
    assert bench.main(argv) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "run.md"]
    rows = json.loads((tmp_path / "run.json").read_text())["rows"]
    ours = {(r["suite"], r["case"]): r for r in rows if r["is_ours"]}
    assert {suite for suite, _ in ours} == set(suites.SUITES)
    assert len(ours) == sum(len(cases) for cases in suites.TINY_CASES.values())
    for (suite, case), row in ours.items():
        assert row["status"] == "ok", (suite, case, row["error"])
        assert row["value"] > 0 and row["ms"] > 0
        # Three alternating rounds (the default): the row's time is their median.
        assert len(row["rounds_ms"]) == 3 and row["ms"] == pytest.approx(statistics.median(row["rounds_ms"]))
    gathers = [r for r in rows if r["impl"] == "xla_gather"]
    assert any("ragged" in r["case"] for r in gathers)  # the ragged decode batch too, against ours
    for gather in gathers:
        assert gather["check_against"] == "ours" and gather["check_max_abs_diff"] < report.AGREEMENT_ATOL
        assert gather["ratio"] == pytest.approx(ours[("decode", gather["case"])]["value"] / gather["value"])
    for row in (r for r in rows if r["suite"] == "cache"):
        assert row["check_against"] == "expected" and row["check_max_abs_diff"] == 0.0
    markdown = (tmp_path / "run.md").read_text()
    assert "## Targets" in markdown and "### prefix:" in markdown and "implementation='xla'" in markdown


@pytest.mark.full  # the harness's other smokes run by default; the Mosaic kernel's own tests check it
def test_mosaic_gpu_tier_is_timed_beside_ours_and_checked_against_it(tmp_path):
    """--peers ours_mosaic_gpu adds our Mosaic GPU prefill kernel (here in its
    interpreter) to the prefill and prefix suites; its output is compared with ours."""
    argv = ["--tiny", "--no-isolate", "--interpret", "--suite", "prefill,prefix", "--peers", "ours_mosaic_gpu",
            "--reps", "1", "--warmup", "1", "--out", str(tmp_path), "--stem", "run", "--budget-s", "inf"]
    assert bench.main(argv) == 0
    rows = json.loads((tmp_path / "run.json").read_text())["rows"]
    mosaic = {r["suite"]: r for r in rows if r["impl"] == "ours_mosaic_gpu"}
    assert set(mosaic) == {"prefill", "prefix"}
    for suite, row in mosaic.items():
        assert row["status"] == "ok", (suite, row["error"])
        assert row["check_against"] == "ours" and row["check_max_abs_diff"] < report.AGREEMENT_ATOL


# A --full case: every bench_attention.py run on a GPU runs its suites in child processes.
@pytest.mark.full
def test_isolated_suite_runs_in_a_child_process(tmp_path):
    args = bench.parse_args(["--tiny", "--suite", "cache", "--peers", "jax_elementwise", "--ours-impl", "xla",
                             "--reps", "1", "--warmup", "1"])
    jobs = bench.plan_jobs("cache", args)
    rows, meta = suite_jobs.run_suite_isolated("cache", jobs, args, timing.Deadline(math.inf), tmp_path)
    assert [(r["impl"], r["status"]) for r in rows] == [("ours", "ok"), ("jax_elementwise", "ok")]
    assert rows[0]["check_against"] == "expected" and rows[0]["check_max_abs_diff"] == 0.0
    assert meta["gpu"].startswith("cpu")


# --------------------------------------------------------------------------- driver: budget, device, outputs

_CACHE_DRY_RUN = ["--tiny", "--no-isolate", "--suite", "cache", "--ours-impl", "xla", "--peers", "xla_scatter",
                  "--reps", "1", "--warmup", "1"]


def test_budget_counts_from_the_start_of_main_not_from_import(tmp_path, monkeypatch):
    """A run that starts a day after the module was imported still has its whole budget.
    (The clock is shifted, nothing waits: the test does not depend on how long it runs.)"""
    class ADayLater:
        perf_counter = staticmethod(time.perf_counter)

        @staticmethod
        def monotonic() -> float:
            return time.monotonic() + 86_400.0

    monkeypatch.setattr(bench, "time", ADayLater)
    assert bench.main([*_CACHE_DRY_RUN, "--budget-s", "3600", "--out", str(tmp_path), "--stem", "run"]) == 0
    rows = json.loads((tmp_path / "run.json").read_text())["rows"]
    assert [(r["impl"], r["status"]) for r in rows] == [("ours", "ok"), ("xla_scatter", "ok")], rows


def test_exit_code_is_one_when_every_job_failed(tmp_path, monkeypatch, capsys):
    def broken_inputs(case):
        raise RuntimeError("no inputs today")

    monkeypatch.setitem(suites.INPUT_BUILDERS, "cache", broken_inputs)
    assert bench.main([*_CACHE_DRY_RUN, "--budget-s", "inf", "--out", str(tmp_path), "--stem", "run"]) == 1
    rows = json.loads((tmp_path / "run.json").read_text())["rows"]
    assert rows and all(r["status"] == "failed" and "no inputs today" in r["error"] for r in rows)
    assert "no job measured anything (2 failed, 0 skipped)" in capsys.readouterr().err


@pytest.mark.parametrize("isolate", [True, False])
def test_refuses_at_once_without_a_gpu_unless_a_dry_run(tmp_path, monkeypatch, capsys, isolate):
    monkeypatch.setattr(bench, "probe_device", lambda isolate: ("cpu", "cpu"))
    argv = ["--suite", "cache", "--out", str(tmp_path), *([] if isolate else ["--no-isolate"])]
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert "no GPU here" in err and "--tiny" in err and "--interpret" in err
    assert not any(tmp_path.iterdir())  # nothing was run, nothing written


@pytest.mark.parametrize("isolate", [True, False])
def test_device_probe_reports_jaxs_default_device(isolate):
    import jax

    device = jax.devices()[0]
    assert bench.probe_device(isolate) == (device.platform, device.device_kind)
    refusal = bench.no_gpu_message(device.platform, device.device_kind)
    assert (refusal is None) == (device.platform == "gpu")


def test_outputs_go_to_a_results_folder_and_never_to_the_committed_results_by_default():
    started = datetime.datetime(2026, 11, 29, 16, 38, tzinfo=datetime.timezone.utc)
    args = bench.parse_args([])
    assert bench.output_paths(args, "NVIDIA H200", started) == [_BENCH_DIR / "results" / "2026-11-29-1638-nvidia-h200.md"]
    tune = bench.parse_args(["--tune", "--out", "/tmp/x"])
    assert bench.output_paths(tune, "NVIDIA H200", started) == [
        pathlib.Path("/tmp/x/2026-11-29-1638-nvidia-h200-tuning.md")]
    committed = bench.parse_args(["--stem", "results", "--update-committed-md"])
    assert bench.output_paths(committed, "cpu", started) == [_BENCH_DIR / "results" / "results.md",
                                                             _BENCH_DIR / "RESULTS.md"]
    for bad in (["--budget-s", "0"], ["--budget-s", "nan"], ["--stem", "../RESULTS"], ["--max-configs", "-1"],
                ["--suite", "prefix", "--peers", "cudnn"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_peers_of_several_suites_reach_each_suites_process():
    """--peers may name peers of different suites of the run; each suite's child process
    gets them all (it checks none against its own suite alone), and --max-configs too."""
    args = bench.parse_args(["--suite", "prefill,prefix", "--peers", "cudnn,cudnn_paged", "--max-configs", "2"])
    assert args.peer_names == {"cudnn", "cudnn_paged"}
    assert args.forwarded[args.forwarded.index("--max-configs") + 1] == "2"
    child = bench.parse_args([*args.forwarded, "--suite", "prefix", "--child-rows", "/tmp/rows.jsonl",
                              "--child-meta", "/tmp/meta.json"])
    assert child.peer_names == {"cudnn", "cudnn_paged"} and child.max_configs == 2


# A --full case: bench_serving.py's --profile smoke runs its trace reading and summary by default.
@pytest.mark.full
def test_profile_engine_quick_smoke(capsys, tmp_path):
    """profile_engine.py runs end to end on the CPU (tiny model): timings for the window,
    a variant and the dense step, and the optimized HLO of the window kept under --out."""
    profile = _load("profile_engine")
    profile.main(["--quick", "--batches", "2", "--num-steps", "2", "--calls", "1", "--out", str(tmp_path),
                  "--variant", "noopt:xla_backend_optimization_level=0"])
    text = capsys.readouterr().out
    assert "batch 2, engine window, default" in text and "noopt" in text and "dense XLA step" in text
    assert "decode plan: 2 rows, block tables of 16 blocks (256 keys)" in text
    assert "ms/step wall" in text and (tmp_path / "window_b2_default.hlo.txt").read_text().startswith("HloModule")


def test_profile_reads_the_first_gpu_and_names_collectives(tmp_path):
    """With several GPUs in a trace the per-step tables are GPU 0's (each runs the same
    program on its shards); NCCL's kernels form a family of their own."""
    import gzip

    profile = _load("profile_engine")
    meta = [dict(ph="M", name="process_name", pid=pid, args=dict(name=name))
            for pid, name in ((1, "/device:GPU:1"), (2, "/device:GPU:0"), (3, "/host:CPU"))]
    meta += [dict(ph="M", name="thread_name", pid=pid, tid=7, args=dict(name="Stream #13")) for pid in (1, 2, 3)]
    kernels = [dict(ph="X", pid=pid, tid=7, ts=ts, dur=3, name=name)
               for pid, ts, name in ((1, 0, "fusion_1"), (2, 0, "fusion_1"), (2, 5, "ncclDevKernel_AllReduce_Sum_bf16"),
                                     (3, 0, "host work"))]
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as fp:
        json.dump(dict(traceEvents=meta + kernels), fp)
    assert [(e["pid"], e["name"]) for e in profile.device_kernel_events(path)] == [
        (2, "fusion_1"), (2, "ncclDevKernel_AllReduce_Sum_bf16")]
    assert len(profile.device_kernel_events(path, first_device_only=False)) == 3
    assert profile.kernel_family("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "collective (NCCL)"
    assert "| collective (NCCL) | 0.5 | 1.5 |" in profile.summarize(profile.device_kernel_events(path), 2)


def test_idle_gaps_are_split_by_length_between_merged_busy_intervals():
    """Overlapping events are one busy interval; each gap between intervals lands in the
    range of its length."""
    profile = _load("profile_engine")
    events = [dict(ts=0, dur=5), dict(ts=2, dur=4), dict(ts=8, dur=2), dict(ts=200, dur=10), dict(ts=5000, dur=1)]
    assert profile.idle_gaps_us(events) == [("< 10 us", 1, 2.0), ("10-100 us", 0, 0.0), ("100-1000 us", 1, 190.0),
                                             (">= 1000 us", 1, 4790.0)]


def test_profile_engine_decode_config_replaces_the_table_for_the_run(capsys, monkeypatch):
    from jax_paged_attn import tuning

    monkeypatch.setattr(tuning, "decode_config", tuning.decode_config)  # restored after the test
    profile = _load("profile_engine")
    profile.main(["--quick", "--batches", "2", "--num-steps", "2", "--calls", "1", "--no-dense",
                  "--decode-config", "pages_per_step=1,num_warps=2,prefetch_page_ids=true"])
    assert "decode kernel config for this run: DecodeConfig(pages_per_step=1" in capsys.readouterr().out
    chosen = tuning.decode_config(128, 16, 4)
    assert (chosen.pages_per_step, chosen.num_warps, chosen.prefetch_page_ids) == (1, 2, True)


def test_bench_engine_decode_config_parses_fields():
    from jax_paged_attn import tuning

    bench = _load("bench_engine")
    config = bench.parse_decode_config("pages_per_step=16,num_splits=1,num_warps=8,prefetch_page_ids=false")
    assert config == tuning.DecodeConfig(pages_per_step=16, num_splits=1, num_warps=8, prefetch_page_ids=False)
    with pytest.raises(TypeError):
        bench.parse_decode_config("pages_per_stepp=16")


def test_profile_engine_tables_cover_table_keys():
    """The profiled batch's block tables are as wide as the engine makes them for requests
    ending at ``--table-keys`` (the decode kernel's splits are planned from the width)."""
    from flax import nnx

    from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM

    profile = _load("profile_engine")
    model = LlamaForCausalLM(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    runner, _ = profile.window_runner(model, 2, 40, 4, 16, None, table_keys=256)
    assert runner.kv_caches[0].shape[1] == 2 * 16 + 1
    runner, _ = profile.window_runner(model, 2, 300, 4, 16, None, table_keys=256)
    assert runner.kv_caches[0].shape[1] == 2 * 19 + 1  # at least the window's end: ceil(304 / 16)


PTXAS_VERBOSE = """\
ptxas info    : 11 bytes gmem
ptxas info    : Compiling entry function 'varlen_attention' for 'sm_90a'
ptxas info    : Function properties for varlen_attention
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 228 registers, used 1 barriers
ptxas info    : Compiling entry function 'loop_add_fusion' for 'sm_90a'
ptxas info    : Function properties for loop_add_fusion
    8 bytes stack frame, 24 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem, 400 bytes cmem[0]
"""


def test_kernel_resources_reads_ptxas_verbose_output():
    resources = _load("kernel_resources")
    entries = resources.parse_ptxas_verbose(PTXAS_VERBOSE)
    assert [(e.name, e.arch, e.registers, e.spill_store_bytes, e.spill_load_bytes, e.shared_bytes)
            for e in entries] == [("varlen_attention", "sm_90a", 228, 0, 0, None),
                                  ("loop_add_fusion", "sm_90a", 255, 24, 16, 1024)]
    assert resources.parse_overrides(["masked_block_k=16", "pack_gqa=False"]) == {
        "masked_block_k": 16, "pack_gqa": False}
    with pytest.raises(SystemExit, match="FIELD=VALUE"):
        resources.parse_overrides(["masked_block_k"])


# Mosaic GPU's ptxas report (MOSAIC_GPU_DUMP_PTXAS): the warnings and ptxas's performance
# notes come before their function's entry line (C7507 without naming it).
MOSAIC_PTXAS_REPORT = """\
ptxas info    : (C7513) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma \
instructions defining input registers of a wgmma between start and end of the pipeline stage in the function \
'attention_mosaic_gpu_kernel'
ptxas warning : Registers are spilled to local memory in function 'attention_mosaic_gpu_kernel', 220 bytes \
spill stores, 288 bytes spill loads
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'attention_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for attention_mosaic_gpu_kernel
    200 bytes stack frame, 220 bytes spill stores, 288 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 200 bytes cumulative stack size, 1 bytes smem
ptxas info    : Compiling entry function 'other_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for other_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 90 registers, used 1 barriers
ptxas info    : (C7507) Potential Performance Loss: 'setmaxnreg' ignored to maintain minimum register requirements.
ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the function 'persistent_mosaic_gpu_kernel'
ptxas info    : Compiling entry function 'persistent_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Used 168 registers, used 16 barriers
        /*0440*/                   STL [R1+0x18], R9 ;
        /*0450*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*0460*/                   LDL.LU R5, [R1+0x10] ;
        /*0470*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0480*/                   LDL R6, [R1+0x14] ;
        /*0490*/                   STS [R2], R7 ;
        /*04a0*/                   LDS.128 R8, [R3] ;
        /*04b0*/                   LDGSTS.E [R4], desc[UR4][R6.64] ;
"""


# SASS of two nested loops (the inner one issuing wgmma), a barrier wait's retry placed out
# of line (its way back an unconditional branch) and a spin loop without wgmma.
NESTED_LOOPS_SASS = """\
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
.L_x_2:
        /*0020*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3], R4 ;
        /*0030*/              @!P0 BRA `(.L_x_9) ;
.L_x_3:
        /*0040*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0 ;
        /*0050*/                   LDL R5, [R1+0x8] ;
        /*0060*/                   MUFU.EX2 R6, R6 ;
        /*0070*/                   ISETP.NE.AND P1, PT, R2, R7, PT ;
        /*0080*/               @P1 BRA `(.L_x_2) ;
        /*0090*/                   STL [R1+0x4], R2 ;
        /*00a0*/               @P2 BRA `(.L_x_1) ;
        /*00b0*/                   EXIT ;
.L_x_9:
        /*00c0*/                   SYNCS.PHASECHK.TRANS64 P0, [R3], R4 ;
        /*00d0*/              @!P0 BRA `(.L_x_9) ;
        /*00e0*/                   BRA `(.L_x_3) ;
"""


def test_kernel_resources_finds_the_innermost_wgmma_loops():
    """The per-block loops of a kernel's SASS: innermost loops closed by a conditional
    branch back that issue wgmma, with their instruction counts; not the outer loop, not
    a wait's out-of-line retry and its way back, not a loop without wgmma."""
    resources = _load("kernel_resources")
    loops = resources.innermost_wgmma_loops(NESTED_LOOPS_SASS)
    assert [(loop.start, loop.end, loop.instructions, loop.counts) for loop in loops] == [
        (0x20, 0x80, 7, {"HGMMA": 1, "STL": 0, "LDL": 1, "MUFU": 1})]


def test_kernel_resources_reads_mosaic_gpu_reports():
    """A performance note marks the entry it names (ptxas prints it before the entry), or,
    naming none (C7507), the next entry; SASS spill instructions are STL / LDL, not
    shared-memory or async-copy ones."""
    resources = _load("kernel_resources")
    entries = resources.parse_ptxas_verbose(MOSAIC_PTXAS_REPORT)
    assert [(e.name, e.registers, e.spill_store_bytes, e.spill_load_bytes, e.serialized_wgmma) for e in entries] == [
        ("attention_mosaic_gpu_kernel", 168, 220, 288, True), ("other_mosaic_gpu_kernel", 90, 0, 0, False),
        ("persistent_mosaic_gpu_kernel", 168, None, None, True)]
    assert entries[0].performance_notes == (
        "C7513 wgmma.mma_async instructions are serialized due to non wgmma instructions defining input registers "
        "of a wgmma between start and end of the pipeline stage",)
    assert entries[2].performance_notes == (
        "C7507 'setmaxnreg' ignored to maintain minimum register requirements",
        "C7512 wgmma.mma_async instructions are serialized due to insufficient register resources")
    assert "; ptxas: C7513 wgmma.mma_async instructions are serialized" in resources.describe(entries[0])
    assert "ptxas" not in resources.describe(entries[1])
    assert resources.count_spill_instructions(MOSAIC_PTXAS_REPORT) == {
        "STL": 1, "LDL": 2, "STL_among_wgmma": 0, "LDL_among_wgmma": 1}


def test_kernel_resources_refuses_without_a_gpu(capsys, monkeypatch, tmp_path):
    resources = _load("kernel_resources")
    monkeypatch.setattr(resources.shutil, "which", lambda name: "/usr/bin/ptxas")
    monkeypatch.setenv("XLA_FLAGS", "")
    assert resources.main(["--out", str(tmp_path)]) == 2
    assert "no GPU here" in capsys.readouterr().err
    assert resources.main(["--implementation", "mosaic_gpu", "--sass"]) == 2  # (no ptxas needed there)
    assert "no GPU here" in capsys.readouterr().err


# A --full case: the weight-streaming kernel's own tests check it; the script runs in the GPU
# sessions that measure it (`gpu_session.sh matmul`).
@pytest.mark.full
def test_matmul_benchmark_dry_run_times_both_and_checks_the_kernel(tmp_path, monkeypatch, capsys):
    bench_matmul = _load("bench_matmul")
    monkeypatch.setattr(sys, "argv", ["bench_matmul.py", "--interpret", "--rows", "3", "--budget-s", "inf",
                                      "--out", str(tmp_path)])
    bench_matmul.main()
    records = json.loads((tmp_path / "matmul.json").read_text())["records"]
    assert [r["product"] for r in records] == [p[0] for p in bench_matmul.PRODUCTS]
    for record in records:
        assert record["xla_ms"] > 0 and record["ours_ms"] > 0, record
        assert record["ours_rel_err"] < 1e-2, record
    assert "| 3 |" in capsys.readouterr().out  # the per-step table


# A --full case: the script times the Mosaic GPU kernel in its interpreter call after call (minutes
# of a CPU run for the suite); the kernel itself is checked by the kernel tests, and the script
# runs on the GPU in the sessions that measure with it (`gpu_session.sh parts`).
@pytest.mark.full
def test_prefill_parts_dry_run_checks_the_kernel_against_the_whole_call(monkeypatch, capsys):
    """`prefill_parts.py --interpret`: the plan, the kernel alone (its output equal to
    the whole call's, or the script raises) and the whole call, on one small shape in
    the Mosaic GPU interpreter; a config field from the command line reaches the kernel;
    a ``--versus`` variant of two fields, checked against the config's output, timed in
    the same rounds."""
    parts = _load("prefill_parts")
    monkeypatch.setattr(sys, "argv", ["prefill_parts.py", "--interpret", "--reps", "1",
                                      "--config", "nonfinite_check='probe'",
                                      "--versus", "nonfinite_check='key_flags'", "masked_block_k=64"])
    assert parts.main() == 0
    out = capsys.readouterr().out
    assert "alternating rounds, medians: config's kernel " in out
    assert "versus {'nonfinite_check': 'key_flags', 'masked_block_k': 64}: " in out
    assert "config overrides {'nonfinite_check': 'probe'}" in out
    assert "B2 S80 Hq2 Hk1 D64, MosaicPrefillConfig(" in out
    assert "nonfinite_check='probe'" in out and "warp_specialized=False" in out
    assert "(1 compute warpgroups, block_k 64, work rows 0): full " in out
    assert " plan " in out and " kernel " in out and " kernel_once " in out


@pytest.mark.full  # (as the case above)
def test_prefill_parts_dry_run_of_the_prefix_suite_over_a_paged_cache(monkeypatch, capsys):
    """`prefill_parts.py --interpret --suite prefix`: bench_attention's (tiny) prefix case,
    new tokens over a paged cache, through the whole call, the plan and the kernel alone
    with the block table (the kernel's output equal to the whole call's, or the script
    raises); no dense shape runs without ``--case``."""
    parts = _load("prefill_parts")
    monkeypatch.setattr(sys, "argv", ["prefill_parts.py", "--interpret", "--reps", "1", "--suite", "prefix"])
    assert parts.main() == 0
    out = capsys.readouterr().out
    assert "prefix: B2 q16 k88 Hq4 Hk2 D32 page16, MosaicPrefillConfig(" in out
    assert " plan " in out and " kernel " in out and " kernel_once " in out
    assert "S80" not in out  # (the dense dry-run shape)


# A --full case: the script times the Mosaic GPU kernel in its interpreter call after call (minutes
# of a CPU run for the suite); the kernel itself is checked by the kernel tests, and the script
# runs on the GPU in the sessions that measure with it (`gpu_session.sh parts`).
@pytest.mark.full
def test_decode_parts_dry_run_compares_configs_and_the_triton_kernel(monkeypatch, capsys):
    """`decode_parts.py --interpret`: the Mosaic GPU decode kernel with the default config
    and a warp-specialized one taking both sequences in one program, and the Triton
    kernel, on one small shape (every output checked against the first config's, or the
    script raises), with a page size given."""
    parts = _load("decode_parts")
    monkeypatch.setattr(sys, "argv", ["decode_parts.py", "--interpret", "--triton", "--page-size", "32",
                                      "--versus", "compute_warpgroups=2", "num_stages=3",
                                      "items_per_program=2"])
    assert parts.main() == 0
    out = capsys.readouterr().out
    assert "B2 ctx100 Hq8 Hk2 D64 page32:" in out
    assert "compute_warpgroups=1, items_per_program=0)" in out  # the package's config first
    assert "num_stages=4, num_splits=1, compute_warpgroups=2, items_per_program=2, query_rows=8, copy_rows=32)" in out
    assert "the Triton kernel" in out and out.count(" ms, ") == 3


def test_prefill_parts_timeline_summary_of_a_profiler_trace():
    """`parts_common.summarize_timeline` on a hand-made Mosaic GPU profiler trace: two
    blocks of two compute warpgroups and a producer, one after the other on SM 0 (clock
    2,000 MHz: 2,000 cycles, 1 µs, are 2.0 in a timestamp past the block's first)."""

    def events(tid, start, regions):  # regions: (name, begin cycles, end cycles)
        out = []
        for name, begin, end in regions:
            out += [{"name": name, "ph": "B", "ts": start + begin / 1e3, "pid": 1, "tid": tid},
                    {"name": name, "ph": "E", "ts": start + end / 1e3, "pid": 1, "tid": tid}]
        return out

    trace = {"traceEvents": [
        # block 0 (tids 1-3) from 100 µs: compute 0 busy to 10 µs, compute 1 to 8, producer to 6
        *events(1, 100.0, [("setup", 0, 2000), ("unmasked", 2000, 14000), ("epilogue", 14000, 20000)]),
        *events(2, 100.0, [("setup", 0, 2000), ("unmasked", 2000, 16000)]),
        *events(3, 100.0, [("setup", 0, 2000), ("refill", 2000, 12000)]),
        # block 1 (tids 4-6) from 112 µs (2 µs after block 0 ended): 4 µs long
        *events(4, 112.0, [("setup", 0, 2000), ("unmasked", 2000, 8000)]),
        *events(5, 112.0, [("setup", 0, 2000), ("unmasked", 2000, 8000)]),
        *events(6, 112.0, [("setup", 0, 2000), ("refill", 2000, 6000)]),
    ]}
    summary = parts_common.summarize_timeline(trace, 2000.0, compute_warpgroups=2)
    assert (summary["blocks"], summary["sms"]) == (2, 1)
    assert summary["span_us"] == pytest.approx(16.0)  # 100 .. 116
    assert summary["block_us"] == pytest.approx(7.0)  # (10 + 4) / 2
    assert summary["busy"] == pytest.approx(14.0 / 16.0)
    assert summary["gap_us"] == pytest.approx(2.0)
    compute = summary["regions"]["compute"]  # per compute warpgroup and block
    assert compute["setup"] == pytest.approx(1.0)
    assert compute["unmasked"] == pytest.approx((6 + 7 + 3 + 3) / 4)
    assert compute["epilogue"] == pytest.approx(3 / 4)
    assert summary["regions"]["producer"] == pytest.approx({"setup": 1.0, "refill": (5 + 2) / 2})
    text = parts_common.format_timeline(summary)
    assert "2 blocks on 1 SMs" in text and "gap between blocks on an SM 2.00 µs" in text
    assert "compute (µs a block): setup 1.00, unmasked 4.75, epilogue 0.75" in text


def test_prefill_parts_unwraps_a_32_bit_cycle_count():
    """An event the profiler read as 2^32 cycles past its trace's first (its overhead
    correction took it below the first: an unsigned count wrapped) is read 2^32 cycles
    earlier: the region ends where it began, not 2 seconds later."""
    wrapped = 10.0 + (parts_common.CLOCK_WRAP - 5) / 1e3
    trace = {"traceEvents": [
        {"name": "setup", "ph": "B", "ts": 10.0, "pid": 1, "tid": 1},
        {"name": "setup", "ph": "E", "ts": wrapped, "pid": 1, "tid": 1},
        {"name": "unmasked", "ph": "B", "ts": 10.0 + 4000 / 1e3, "pid": 1, "tid": 1},
        {"name": "unmasked", "ph": "E", "ts": 10.0 + 8000 / 1e3, "pid": 1, "tid": 1},
    ]}
    summary = parts_common.summarize_timeline(parts_common._unwrap_cycles(trace), 2000.0, compute_warpgroups=1,
                                       has_producer=False)
    assert summary["span_us"] == pytest.approx(4.0)
    assert summary["regions"]["compute"]["setup"] == pytest.approx(-0.0025)
    assert summary["regions"]["compute"]["unmasked"] == pytest.approx(2.0)


def test_prefill_parts_fits_the_sm_clock_to_the_block_starts():
    """`parts_common.fit_clock_mhz`: blocks of different lengths (in cycles) one after
    the other on two SMs, 1.5 µs apart, at 1,500 MHz: the fit finds both, where the
    maximum clock (2,000 MHz) would read the blocks short and the gaps long."""
    clock, gap = 1500.0, 1.5

    def trace(lengths_by_sm):
        events, tid = [], 1
        for sm, lengths in lengths_by_sm.items():
            start = 50.0
            for cycles in lengths:
                for warpgroup in range(3):  # two compute warpgroups and the producer
                    end = cycles - 300 * warpgroup
                    events += [{"name": "setup", "ph": "B", "ts": start, "pid": sm, "tid": tid},
                               {"name": "setup", "ph": "E", "ts": start + end / 1e3, "pid": sm, "tid": tid}]
                    tid += 1
                start += cycles / clock + gap
        return {"traceEvents": events}

    varied = trace({1: [3000, 9000, 4500, 12000], 2: [6000, 1500, 7500]})
    fitted_clock, fitted_gap = parts_common.fit_clock_mhz(varied, warpgroups=3)
    assert fitted_clock == pytest.approx(clock) and fitted_gap == pytest.approx(gap)
    assert parts_common.summarize_timeline(varied, 2000.0, 2)["gap_us"] > gap + 0.5
    assert parts_common.summarize_timeline(varied, fitted_clock, 2)["gap_us"] == pytest.approx(gap)
    # Blocks all of one length: a clock and a gap cannot be told apart.
    assert parts_common.fit_clock_mhz(trace({1: [4000] * 4, 2: [4000] * 3}), warpgroups=3) is None


def test_prefill_parts_refuses_without_a_gpu(monkeypatch, capsys):
    parts = _load("prefill_parts")
    monkeypatch.setattr(sys, "argv", ["prefill_parts.py"])
    assert parts.main() == 2
    assert "needs a GPU" in capsys.readouterr().err


def test_max_configs_keeps_a_sweep_to_its_first_configs():
    """Context.max_configs: a swept peer times only its first N configs (the package
    default comes first in every grid); 0 times them all."""
    timer = timing.Timer(warmup=1, reps=1)
    deadline = timing.Deadline(float("inf"))
    make_call = lambda c: (lambda: jnp.full((2,), c, jnp.float32))  # noqa: E731
    kept = timing.Context(timer, deadline, max_configs=2).sweep([1.0, 2.0, 3.0], make_call)
    assert [t["config"] for t in kept.sweep] == ["1.0", "2.0"] and kept.note == "best of 2/2 configs"
    every = timing.Context(timer, deadline).sweep([1.0, 2.0, 3.0], make_call)
    assert len(every.sweep) == 3


def test_prefill_parts_variant_check_allows_rounding_not_a_wrong_kernel():
    """`prefill_parts.check_variant`: another block size may round differently, within
    `VARIANT_TOLERANCE`; a larger difference or a NaN in another place is an error."""
    parts = _load("prefill_parts")
    expected = jnp.array([[0.5, -1.25], [jnp.nan, 2.0]], jnp.bfloat16)
    parts.check_variant(expected + jnp.array(0.0078125, jnp.bfloat16), expected, {"block_k": 64})
    with pytest.raises(AssertionError, match="block_k.*max \\|diff\\| 0.25"):
        parts.check_variant(expected.at[0, 0].add(0.25), expected, {"block_k": 64})
    with pytest.raises(AssertionError, match="disagree"):
        parts.check_variant(expected.at[0, 1].set(jnp.nan), expected, {"block_k": 64})


def test_parts_scripts_parse_their_shapes():
    """``--case`` of `prefill_parts.py` (B,S,HQ,HK,D) and `decode_parts.py`
    (B,CTX,HQ,HK[,D], head size 128 by default); a malformed one exits naming the option."""
    prefill_parts, decode_parts = _load("prefill_parts"), _load("decode_parts")
    assert prefill_parts.parse_shape("8,2048,32,8,128") == (8, 2048, 32, 8, 128)
    case = decode_parts.parse_case("512,4096,4,1")
    assert (case.batch, case.context, case.q_heads, case.kv_heads, case.head_dim) == (512, 4096, 4, 1, 128)
    assert decode_parts.parse_case("2,100,8,2,64").head_dim == 64
    for parse, text in ((prefill_parts.parse_shape, "8,2048,32,8"), (decode_parts.parse_case, "8,x,1,1"),
                        (decode_parts.parse_case, "0,100,8,2")):
        with pytest.raises(SystemExit, match="--case takes"):
            parse(text)


# --------------------------------------------------------------------------- engine benchmarks


def _loaded(name: str):
    """The benchmarks' module ``name``, loaded once: `engine_common` registers its JAX
    event listeners when it runs."""
    return sys.modules.get(name) or _load(name)


def _table(text: str, first_column: str) -> tuple[list[str], list[list[str]]]:
    """The markdown table of ``text`` whose header starts with ``first_column``: (header, rows)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_column} |"))
    table = itertools.takewhile(lambda line: line.startswith("|"), lines[start:])  # a table ends at its first other line
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table]
    end = next((i for i, row in enumerate(cells) if i > 1 and row == cells[0]), len(cells))
    return cells[0], cells[2:end]


# The engine benchmarks' smoke runs on an engine with one batch and one token bucket: a
# program per count (half the programs of the scripts' --quick buckets, each a compile);
# every part of the scripts still runs.
_ONE_PROGRAM_PER_COUNT = ["--max-num-batched-tokens", "32", "--engine-option", "batch_buckets=4,",
                          "--engine-option", "token_buckets=32,"]


def test_bench_engine_quick_times_generate_and_the_one_jit_loop_gives_the_engines_tokens(capsys):
    """The engine table on the tiny float32 model: every contender measured, and the
    one-jit dense loop's greedy tokens identical to the engine's on every row."""
    from jax_paged_attn.engine import LLMEngine

    bench = _loaded("bench_engine")
    rows = bench.main(["--quick", "--batches", "3", *_ONE_PROGRAM_PER_COUNT])
    header, cells = _table(capsys.readouterr().out, "batch")
    assert tuple(header) == bench.TABLE_COLUMNS and len(cells) == 1
    for row, row_cells in zip(rows, cells):
        assert row["rows_matching_one_jit"] == row["batch"], row
        assert min(row["engine_wall_tok_s"], row["one_jit_tok_s"], row["per_step_tok_s"]) > 0
        assert row["engine_generate_ms"] <= row["engine_generate_first_ms"]
        compiles = int(row_cells[header.index("compiles after start")])
        assert compiles == row["compiles_after_start"]
        if hasattr(LLMEngine, "warmup"):  # warmed up by it: nothing left to compile
            assert compiles == 0, row


def test_bench_tp_quick_reruns_on_forced_cpu_devices_and_compares_tp_2_with_tp_1(capsys):
    """`bench_tp.py --quick` on a one-device host reruns itself on 2 forced CPU devices
    (one process, both tensor-parallel sizes): a row per size, the tp=2 row's ratio to
    tp=1, its weight-read floor, nothing compiled after the warm-up."""
    bench = _loaded("bench_tp")
    rows = bench.main(["--quick", "--num-scheduler-steps", "2", "--max-num-batched-tokens", "16",
                       "--engine-option", "batch_buckets=2,", "--engine-option", "token_buckets=16,",
                       "--engine-option", "compilation_cache=False"])
    header, cells = _table(capsys.readouterr().out, "model")
    assert header == bench.table_columns([1, 2]) and "tp=2 / tp=1" in header
    assert [(row["tp"], row["batch"]) for row in rows] == [(1, 2), (2, 2)]
    assert rows[1]["speedup_vs_tp1"] > 0 and cells[1][header.index("tp=2 / tp=1")] != "n/a"
    assert rows[1]["floor_ms_per_step"] == pytest.approx(rows[0]["floor_ms_per_step"] / 2)
    assert all(row["compiles_after_start"] == 0 and row["decode_tok_s"] > 0 for row in rows), rows


def test_engine_options_reach_the_engine_config_and_unknown_fields_are_named(capsys):
    common = _loaded("engine_common")
    options = common.parse_engine_options(["batch_buckets=8,32", "num_scheduler_steps=4", "max_model_len=None",
                                           "enable_prefix_caching=FALSE", "gpu_memory_utilization=0.5"])
    assert options == dict(batch_buckets=(8, 32), num_scheduler_steps=4, max_model_len=None,
                           enable_prefix_caching=False, gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match="EngineConfig has no field 'max_num_seq'"):
        common.parse_engine_options(["max_num_seq=8"])
    with pytest.raises(ValueError, match="expected FIELD=VALUE"):
        common.parse_engine_options(["max_num_seqs"])
    config = common.engine_config(dict(max_num_seqs=4, num_scheduler_steps=16, retired_field=1), options)
    assert (config.max_num_seqs, config.num_scheduler_steps, config.batch_buckets) == (4, 4, (8, 32))
    assert "EngineConfig has no field retired_field: the benchmark's retired_field=1 not applied" in \
        capsys.readouterr().out


def test_compile_counter_counts_xla_compilations_of_this_process():
    import jax

    common = _loaded("engine_common")
    counter = common.CompileCounter()
    f = jax.jit(lambda x: x * 3 + 1)
    f(np.arange(5))
    assert counter.count == 1 and counter.seconds > 0
    f(np.arange(5))  # cached: no compilation
    assert counter.count == 1
    counter.restart()
    f(np.arange(6))  # a new shape
    assert counter.count == 1 and counter.cache_hits == 0


def test_serving_workload_is_the_one_the_earlier_serving_runs_measured():
    serving = _loaded("bench_serving")
    workload = serving.make_workload(1000, 32000)
    # The draws of `bench_engine.py --serving` (seed 0), whose figures README and RESULTS quote.
    assert (workload.prompt_tokens, workload.output_tokens) == (1_072_199, 268_435)
    assert all(32 <= len(p) <= 2048 for p in workload.prompts)
    assert all(16 <= p.max_tokens <= 512 and p.temperature == 0.0 and p.ignore_eos for p in workload.params)


def test_poisson_arrivals_and_the_rates_option():
    serving = _loaded("bench_serving")
    assert not serving.poisson_arrivals(5, float("inf")).any()
    slow, fast = serving.poisson_arrivals(4000, 2.0), serving.poisson_arrivals(4000, 8.0)
    assert slow[0] == 0 and np.all(np.diff(slow) >= 0)
    np.testing.assert_allclose(slow, 4 * fast)  # one pattern, scaled by the rate
    assert np.mean(np.diff(slow)) == pytest.approx(0.5, rel=0.05)
    assert serving.parse_rates("8,16,inf") == ["inf", "8", "16"]
    assert serving.parse_rates("0.5x,4") == ["inf", "0.5x", "4"]
    assert serving.parse_rates("3") == ["3"]
    for bad in ("0", "fast", "-2x", ""):
        with pytest.raises(ValueError, match="--rates"):
            serving.parse_rates(bad)


class _StepClockEngine:
    """An engine double on its own clock: each read of the clock advances it 1 ms; a step
    takes 1 s and finishes every request submitted before it, its first token half-way."""

    def __init__(self):
        import types

        self.now, self.pending, self.stats = 0.0, [], types.SimpleNamespace()

    def clock(self):
        self.now += 1e-3
        return self.now

    def reset_stats(self):
        pass

    def add_request(self, prompt, params, request_id):
        self.pending.append((request_id, self.now, params.max_tokens))

    def has_unfinished_requests(self):
        return bool(self.pending)

    def step(self):
        import types

        start, self.now = self.now, self.now + 1.0
        done = [types.SimpleNamespace(request_id=rid, outputs=[types.SimpleNamespace(token_ids=[0] * n)],
                                      time_to_first_token_s=start + 0.5 - at, latency_s=self.now - at)
                for rid, at, n in self.pending]
        self.pending = []
        self.finished = {o.request_id: o for o in done}
        return done

    def pop_output(self, request_id):
        return self.finished.pop(request_id)


def test_arrival_loop_submits_on_time_and_counts_the_wait_for_a_running_step():
    """Request 1 arrives while the first step runs: it is submitted when the step returns
    and its TTFT counts from its arrival. The loop idles until request 2 arrives."""
    from jax_paged_attn.engine import SamplingParams

    serving = _loaded("bench_serving")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    workload = serving.Workload([[1, 2], [3], [4, 5, 6]], [params] * 3)
    engine = _StepClockEngine()
    row = serving.run_arrivals(engine, workload, np.array([0.0, 0.2, 5.0]), "t", clock=engine.clock)
    assert row["requests"] == 3 and row["generated_tokens"] == 9 and row["compiles_after_start"] == 0
    assert row["max_late_ms"] == pytest.approx(800, abs=5)  # submitted at the first step's end, 1 s
    assert row["ttft_ms"][0] == pytest.approx(500, abs=5)  # two of three requests waited for no step
    assert row["ttft_ms"][2] == pytest.approx(1300, abs=20)  # p99: request 1, 0.8 s late + 0.5 s
    np.testing.assert_allclose(row["tpot_ms"], 250, atol=1)  # (1 s - 0.5 s) / 2 tokens
    assert row["duration_s"] == pytest.approx(6.0, abs=0.02)  # request 2 arrives at 5 s, one 1 s step


_SMALL_SERVING = ["--quick", "--num-requests", "8", "--max-num-seqs", "4", "--prompt-lens", "4,24",
                  "--output-lens", "2,12", "--max-model-len", "64", *_ONE_PROGRAM_PER_COUNT]


def test_bench_serving_quick_sweeps_two_rates_with_no_compile_after_start(capsys, tmp_path):
    """Two rates, the sum of parts, and ``--profile``: the workload once more under JAX's
    profiler, its trace written and summarized (a CPU trace has no GPU kernels)."""
    serving = _loaded("bench_serving")
    result = serving.main([*_SMALL_SERVING, "--rates", "40,inf", "--profile", str(tmp_path)])
    out = capsys.readouterr().out
    assert "# profiled run (all at once, under the profiler): " in out and "| kernel family | kernels / run |" in out
    assert "| idle gap between busy intervals | gaps | seconds |" in out
    assert result["profile"]["duration_s"] > 0 and list(tmp_path.glob("plugins/profile/*/perfetto_trace.json.gz"))
    header, cells = _table(out, "request rate (req/s)")
    assert tuple(header) == serving.SERVING_COLUMNS and "total tok/s" in header
    assert [row[0] for row in cells] == ["inf", "40"]
    assert [row["rate_entry"] for row in result["rows"]] == ["inf", "40"]
    assert result["parts"]["prefill_tok_s"] > 0 and result["parts"]["decode_tok_s"] > 0
    for row, row_cells in zip(result["rows"], cells):
        assert row["requests"] == 8 and row["total_tok_s"] > row["output_tok_s"] > 0
        assert row_cells[header.index("sum of parts s")] == f"{result['sum_of_parts_s']:.2f}"
        assert int(row_cells[header.index("compiles after start")]) == row["compiles_after_start"] == 0
        assert row["steps"] >= row["mixed_steps"] >= 1 and row["decode_step_s"] + row["prompt_step_s"] > 0
        assert f"rate {row['rate_entry']}: {row['steps']:,} engine steps ({row['mixed_steps']:,} with prompts" in out


# A --full case: the program store's round trip runs by default in test_engine.py
# (a second engine loads its programs) and test_program_store.py (a start in a fresh
# process loads every program untraced); this script's two-process start runs on
# a GPU in `benchmarks/gpu_session.sh startup` (the README's start-up figures).
@pytest.mark.full
def test_bench_serving_startup_serves_the_second_start_from_the_persistent_cache(capsys):
    serving = _loaded("bench_serving")
    result = serving.main([*_SMALL_SERVING, "--startup"])
    cold, warm = result["cold"], result["warm"]
    assert cold["compiles"] > 0 and cold["programs_stored"] > 0
    # the engine's programs come back from its program store, untraced; what else
    # compiles comes back from JAX's cache
    assert warm["programs_loaded"] == cold["programs_stored"] and warm["programs_stored"] == 0, warm
    assert warm["traced"] <= cold["programs_unserializable"], warm  # see the engine's program-store test
    assert warm["cache_hits"] == warm["compiles"], warm
    assert warm["kv_cache_blocks"] == cold["kv_cache_blocks"]  # the same cache shape, the same programs
    assert result["warm_over_cold"] == pytest.approx(warm["start_s"] / cold["start_s"])
    out = capsys.readouterr().out
    assert "| cold |" in out and "| warm |" in out and "warm / cold start:" in out and "| KV cache blocks |" in out
