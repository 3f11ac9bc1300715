"""The user tuning tables and the tuner (`python3 -m jax_paged_attn.tune`) on a CPU: the
file format, where lookups take their configs from (explicit > user > shipped >
defaults), files that must not be used, the command end to end with fake timings, and
the start report's line about the tables."""
import dataclasses
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_paged_attn import prefill, tune, tuning
from jax_paged_attn.spec import AttentionSpec

H200 = tuning.REFERENCE_DEVICE
PCIE = tuning.TuningDevice("NVIDIA H100 PCIe", 227 * 1024)
SHIPPED_KEY = next(iter(tuning.MEASURED_TABLES[H200.kind]["PREFILL_TABLE"]))
SHIPPED = tuning.MEASURED_TABLES[H200.kind]["PREFILL_TABLE"][SHIPPED_KEY]
MINE = dataclasses.replace(SHIPPED, block_q=32, num_stages=5)


@pytest.fixture(autouse=True)
def user_dir(tmp_path, monkeypatch):
    """Every test reads and writes user tables in its own folder, read afresh."""
    monkeypatch.setenv(tuning.USER_TABLES_ENV, str(tmp_path))
    monkeypatch.setattr(tuning, "_user_tables", {})
    monkeypatch.setattr(tuning, "_warned_devices", set())
    return tmp_path


def _document(device_kind=H200.kind, jax_version=jax.__version__, prefill_entries=None, decode_entries=()):
    if prefill_entries is None:
        prefill_entries = [tuning.table_entry(device_kind, SHIPPED_KEY, dataclasses.asdict(MINE), 0.99, ["a shape"],
                                              {"date": "today"})]
    return tuning.user_table_document(device_kind, jax_version, "2026-12-06 12:00 UTC", "python3 -m jax_paged_attn.tune",
                                      {"PREFILL_TABLE": list(prefill_entries), "DECODE_TABLE": list(decode_entries)})


def _write(document, device_kind=H200.kind):
    return tuning.write_user_table(tuning.user_table_path(device_kind), document)


def test_a_user_table_round_trips_through_its_file(user_dir):
    decode_entry = tuning.table_entry(PCIE.kind, (128, 16, 4), {"pages_per_step": 2, "prefetch_page_ids": True}, None,
                                      [], {})
    path = _write(_document(PCIE.kind, decode_entries=[decode_entry]), PCIE.kind)
    assert path == user_dir / "nvidia-h100-pcie.json"
    assert [p.name for p in user_dir.iterdir()] == [path.name]  # no temporary file left
    data = json.loads(path.read_text())
    assert (data["format"], data["version"], data["device_kind"], data["jax_version"]) == (
        tuning.USER_TABLE_FORMAT, tuning.USER_TABLE_VERSION, PCIE.kind, jax.__version__)
    table = tuning.read_user_table(path, PCIE.kind, jax.__version__)
    assert table.tables == {"PREFILL_TABLE": {SHIPPED_KEY: MINE},
                            "DECODE_TABLE": {(128, 16, 4): tuning.DecodeConfig(pages_per_step=2, prefetch_page_ids=True)}}
    assert (table.date, table.command, table.path) == ("2026-12-06 12:00 UTC", "python3 -m jax_paged_attn.tune", path)


def test_the_tables_live_beside_the_compilation_cache_unless_moved(monkeypatch, tmp_path):
    monkeypatch.delenv(tuning.USER_TABLES_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert tuning.user_table_path("NVIDIA H800") == tmp_path / "cache" / "jax_paged_attn" / "tuning" / "nvidia-h800.json"
    monkeypatch.setenv(tuning.USER_TABLES_ENV, "off")
    assert tuning.user_table_path("NVIDIA H800") is None and tuning.user_table("NVIDIA H800") is None


def test_lookups_take_explicit_then_user_then_shipped_then_defaults(monkeypatch):
    other_key = next(k for k in tuning.MEASURED_TABLES[H200.kind]["PREFILL_TABLE"] if k != SHIPPED_KEY)
    _write(_document())
    assert tuning.prefill_config(*SHIPPED_KEY, device=H200) == MINE  # the user's table
    assert tuning.prefill_config(*other_key, device=H200) == tuning.MEASURED_TABLES[H200.kind]["PREFILL_TABLE"][
        other_key]  # a key it lacks: the shipped entry
    assert tuning.prefill_config(*SHIPPED_KEY, device=H200, tables=("shipped",)) == SHIPPED
    assert tuning.prefill_config(*SHIPPED_KEY, device=H200, tables=()) == tuning.PREFILL_TABLE[SHIPPED_KEY]
    # An explicit config= is used as given: the tables are not consulted.
    monkeypatch.setattr(tuning, "prefill_config", lambda *a, **k: pytest.fail("looked up despite config="))
    head_size = SHIPPED_KEY[0]
    q = jnp.ones((16, 2, head_size), jnp.float32)
    cu = jnp.array([0, 16], jnp.int32)
    scale = jnp.ones((), jnp.float32)
    out = prefill.varlen_attention(q, q, q, cu, cu, None, None, None, scale, scale,
                                   spec=AttentionSpec.create(head_size, causal=True), max_seqlen_q=16, max_seqlen_k=16,
                                   lowering="triton", interpret=True,
                                   config=tuning.PrefillConfig(block_q=16, block_k=16, masked_block_k=16))
    np.testing.assert_allclose(np.asarray(out), 1.0, rtol=1e-6)


def test_a_user_table_on_an_unshipped_gpu_silences_the_untuned_warning():
    _write(_document(PCIE.kind, prefill_entries=[tuning.table_entry(PCIE.kind, SHIPPED_KEY, dataclasses.asdict(MINE),
                                                                    1.0, [], {})]), PCIE.kind)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuning.prefill_config(*SHIPPED_KEY, device=PCIE) == MINE
        assert tuning.decode_config(128, 16, 4, device=PCIE) == tuning.DecodeConfig()  # not in it: the default


@pytest.mark.parametrize("document, reason", [
    (_document(jax_version="0.0.1"), r"measured with jax 0\.0\.1, this process runs jax"),
    (_document(device_kind="NVIDIA H100 PCIe"), "measured on a NVIDIA H100 PCIe, not this NVIDIA H200"),
    ({**_document(), "version": 99}, "format version 99"),
    ({"PREFILL_TABLE": []}, "not a user tuning table"),
])
def test_a_table_of_another_jax_gpu_or_format_is_said_once_and_not_used(document, reason):
    path = _write(document)
    with pytest.warns(tuning.UserTableWarning, match=f"{path}.*{reason}.*python3 -m jax_paged_attn.tune"):
        assert tuning.prefill_config(*SHIPPED_KEY, device=H200) == SHIPPED
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        assert tuning.prefill_config(*SHIPPED_KEY, device=H200) == SHIPPED
    assert tuning.describe_tables(H200) == "tile configs measured on the NVIDIA H200"


def _entry(key=list(SHIPPED_KEY), **config):
    return {"device": H200.kind, "key": key, "config": config or dataclasses.asdict(MINE)}


@pytest.mark.parametrize("entry, reason", [
    (_entry(block_q=96), r"PREFILL_TABLE entry 0: config.block_q=96 is out of range"),
    (_entry(block_k=8), r"config.block_k=8 is out of range"),
    (_entry(num_warps=4.0), r"config.num_warps must be int"),
    (_entry(pack_gqa=1), r"config.pack_gqa must be bool"),
    (_entry(num_stages_paged="3"), r"config.num_stages_paged must be int \| None"),
    (_entry(warp_specialize=True), r"PrefillConfig has no field\(s\) \['warp_specialize'\]"),
    (_entry(key=[96, "bfloat16", False]), r"key \[96, 'bfloat16', False\] is not a valid key"),
    (_entry(key=[128, "int8", False]), "is not a valid key"),
    ({**_entry(), "device": "NVIDIA H20"}, "device 'NVIDIA H20' is not the table's 'NVIDIA H200'"),
    ("[", None),
])
def test_a_malformed_table_is_named_and_the_shipped_tables_apply(entry, reason):
    path = tuning.user_table_path(H200.kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json" if entry == "[" else json.dumps(_document(prefill_entries=[entry])))
    with pytest.warns(tuning.UserTableWarning, match=f"{path} is not used: .*{reason or 'not JSON'}"):
        assert tuning.prefill_config(*SHIPPED_KEY, device=H200) == SHIPPED


def test_a_decode_entry_is_checked_too():
    path = _write(_document(decode_entries=[{"device": H200.kind, "key": [128, 16, 3], "config": {}}]))
    with pytest.warns(tuning.UserTableWarning, match=rf"{path} is not used: DECODE_TABLE entry 0: .* not a valid key"):
        tuning.decode_config(128, 16, 4, device=H200)


def test_the_start_report_names_the_table_in_force():
    l4 = tuning.TuningDevice("NVIDIA L4", 99 * 1024)
    assert tuning.describe_tables(H200) == "tile configs measured on the NVIDIA H200"
    assert tuning.describe_tables(l4) == ("no tile configs measured on the NVIDIA L4: defaults fitted to its 99 KiB of "
                                          "shared memory per block; `python3 -m jax_paged_attn.tune` measures a "
                                          "table for it")
    path = _write(_document())
    tuning.forget_user_tables()
    assert tuning.describe_tables(H200) == (f"tile configs tuned on this NVIDIA H200 by the user ({path}, 2026-12-06 "
                                            f"12:00 UTC, jax {jax.__version__}; the shipped table measured on it for "
                                            f"other shapes)")


FASTEST_PREFILL = tuning.PrefillConfig(block_q=128, block_k=64, num_warps=8, num_stages=3)
FASTEST_DECODE = tuning.DecodeConfig(pages_per_step=2, num_stages=5, prefetch_page_ids=True)


def fake_measure(case, config):
    """Fake timings: one config of each kind is fastest; one fails as a shared-memory
    overflow would."""
    if config in (FASTEST_PREFILL, FASTEST_DECODE):
        return 1.0
    if getattr(config, "block_k", None) == 32:
        raise RuntimeError("RESOURCE_EXHAUSTED: Shared memory size limit exceeded")
    return 2.0 + getattr(config, "num_stages", 0) / 10


def test_the_command_end_to_end_with_fake_timings(user_dir, capsys):
    assert tune.main(["--head-sizes", "32", "--num-q-heads", "4", "--num-kv-heads", "2", "--interpret", "--quick",
                      "--tuning-dir", str(user_dir)], measure=fake_measure) == 0
    cpu = tuning.TuningDevice(jax.devices()[0].device_kind, 227 * 1024)
    path = tuning.user_table_path(cpu.kind)
    printed = capsys.readouterr().out
    assert f"wrote {path}" in printed and "failed: prefill B2 S64" in printed
    table = tuning.read_user_table(path, cpu.kind, jax.__version__)
    assert table.command.endswith("--interpret --quick --tuning-dir " + str(user_dir))
    assert set(table.tables["PREFILL_TABLE"]) == {(32, "bfloat16", False), (32, "bfloat16", True)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the table is found: nothing to warn about
        assert tuning.prefill_config(32, "bfloat16", False, device=cpu) == FASTEST_PREFILL
        assert tuning.prefill_config(32, "bfloat16", True, device=cpu) == FASTEST_PREFILL
        assert tuning.decode_config(32, 16, 2, device=cpu) == FASTEST_DECODE
    entry = json.loads(path.read_text())["DECODE_TABLE"][0]
    assert entry["score"] == 1.0 and entry["shapes"] == ["decode B2 ctx64 Hq4 Hk2 D32 page16"]
    # A later run for another head size keeps these entries.
    assert tune.main(["--head-sizes", "64", "--num-q-heads", "4", "--num-kv-heads", "2", "--interpret", "--quick"],
                     measure=fake_measure) == 0
    tables = tuning.read_user_table(path, cpu.kind, jax.__version__).tables
    assert {k[0] for k in tables["PREFILL_TABLE"]} == {32, 64} and set(tables["DECODE_TABLE"]) == {(32, 16, 2),
                                                                                                    (64, 16, 2)}
    # --compare times the user table's configs against the shipped ones (the defaults here).
    capsys.readouterr()
    assert tune.main(["--head-sizes", "32", "--num-q-heads", "4", "--num-kv-heads", "2", "--interpret", "--compare",
                      "--rounds", "2"], measure=fake_measure) == 0
    assert "decode B2 ctx64 Hq4 Hk2 D32 page16: user 1.0000 ms, shipped 2.3000 ms, shipped/user x2.300" in (
        capsys.readouterr().out)


def test_the_kernel_measure_runs_a_real_call_in_interpret_mode():
    case = tune.tune_cases(tune.ModelShapes((32,), 4, 2), tiny=True)[0]
    assert tune.kernel_measure(interpret=True, warmup=1, reps=1)(case, FASTEST_DECODE) > 0


def test_ignore_shipped_sweeps_from_the_defaults():
    case = next(c for c in tune.tune_cases(tune.ModelShapes((SHIPPED_KEY[0],), 32, 8), tiny=True)
                if c.key == SHIPPED_KEY)
    tried = []
    tune.sweep([case], lambda c, config: tried.append(config) or 1.0, H200, quick=True, ignore_shipped=True,
               log=lambda _: None)
    assert tried[0] == tuning.PREFILL_TABLE[SHIPPED_KEY] and SHIPPED not in tried[:1]
    tried.clear()
    tune.sweep([case], lambda c, config: tried.append(config) or 1.0, H200, quick=True, log=lambda _: None)
    assert tried[0] == SHIPPED


def test_the_command_refuses_without_a_gpu(capsys):
    assert tune.main(["--head-sizes", "128", "--num-q-heads", "32"], measure=fake_measure) == 2
    assert "no GPU here" in capsys.readouterr().err


def test_shapes_come_from_a_hugging_face_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 2048, "num_attention_heads": 32,
                                                      "num_key_value_heads": 4, "torch_dtype": "float16"}))
    assert tune.ModelShapes.from_hf_config(tmp_path) == tune.ModelShapes((64,), 32, 4, 16, "float16")
    args = tune.parse_args(["--model-config", str(tmp_path / "config.json"), "--block-size", "32"])
    assert args.shapes == tune.ModelShapes((64,), 32, 4, 32, "float16")


@pytest.mark.parametrize("argv, message", [
    (["--head-sizes", "128"], "give --model-config, or --head-sizes and --num-q-heads"),
    (["--head-sizes", "128", "--num-q-heads", "32", "--num-kv-heads", "5"], "num_q_heads .32. must be a multiple"),
    (["--head-sizes", "12x"], "--head-sizes: expected comma-separated ints"),
    (["--head-sizes", "128", "--num-q-heads", "32", "--dtype", "int8"], "dtype must be 'bfloat16' or 'float16'"),
    (["--model-config", "/nonexistent/config.json"], "--model-config: no file"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        tune.parse_args(argv)
    assert __import__("re").search(message, capsys.readouterr().err)


def test_choose_keeps_the_best_geomean_among_configs_that_ran_everywhere():
    times = {"k": {"A": {"s1": 1.0, "s2": 3.0}, "B": {"s1": 1.1, "s2": 2.0}, "C": {"s1": 0.5}}}
    config, score, shapes = tune.choose(times)["k"]
    assert (config, shapes) == ("B", ["s1", "s2"]) and score == pytest.approx(((0.5 / 1.1) * 1.0) ** 0.5)
