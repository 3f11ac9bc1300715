"""The engine's program store (`jax_paged_attn.engine.program_store`): files that cannot
run code by being read, cannot pass for another program, survive upgrades, tears and
concurrent writers, and a cache directory that is used only when it is trusted."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import pickle
import re
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_paged_attn as jpa
from conftest import engine_base, random_prompts
from jax_paged_attn.engine import LLMEngine, SamplingParams
from jax_paged_attn.engine import program_store, startup, trusted_directory
from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = dataclasses.replace(engine_base(), max_model_len=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=3)


class _PlantedPayload:
    """A pickle that, if ever unpickled, creates ``marker`` (what an attacker's file would run)."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def _add(x, y):
    return x + y


def _store_call(directory, fn=_add, args=(jnp.ones(3), jnp.ones(3)), key=("test",), donate_argnums=()):
    """A `StoredProgram` of ``jax.jit(fn)`` over a fresh `ProgramStore`, called once."""
    stored = program_store.StoredProgram(jax.jit(fn, donate_argnums=donate_argnums), "add",
                                         program_store.ProgramStore(directory, list(key)), params_first=False,
                                         donate_argnums=donate_argnums)
    return stored, stored(*args)


def test_the_store_reads_no_pickle_and_a_planted_pickle_runs_nothing(tmp_path, caplog):
    """Files under every name the store reads replaced by a pickle whose loading would
    create a marker: the marker never appears and the program is compiled again, said."""
    source = pathlib.Path(program_store.__file__).read_text()
    imports = re.findall(r"^\s*(?:import|from)\s+(.*)$", source, re.MULTILINE)
    assert not [line for line in imports if "pickle" in line or "serialize_executable" in line]
    stored, out = _store_call(tmp_path)
    assert stored.store.num_stored == 1
    marker = tmp_path / "marker"
    names = list(tmp_path.glob(f"*{program_store.FILE_SUFFIX}"))
    assert names
    for name in names:
        name.write_bytes(pickle.dumps(_PlantedPayload(marker)))
    with caplog.at_level(logging.WARNING):
        again, out_again = _store_call(tmp_path)
    assert not marker.exists()
    assert again.store.num_loaded == 0 and again.store.num_stored == 1
    assert "not a program store file" in caplog.text
    np.testing.assert_array_equal(out_again, out)


def test_a_torn_file_is_compiled_again_and_replaced(tmp_path, caplog):
    stored, out = _store_call(tmp_path)
    (path,) = tmp_path.glob(f"*{program_store.FILE_SUFFIX}")
    whole = path.read_bytes()
    for torn in (whole[:len(whole) - 10], whole[:len(program_store.FILE_MAGIC) + 20]):
        path.write_bytes(torn)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            again, _ = _store_call(tmp_path)
        assert again.store.num_loaded == 0 and again.store.num_stored == 1 and "torn file" in caplog.text
    loaded, out_loaded = _store_call(tmp_path)
    assert loaded.store.num_loaded == 1
    np.testing.assert_array_equal(out_loaded, out)


def test_a_file_whose_key_matches_but_whose_program_does_not_is_refused_before_it_runs(tmp_path, caplog):
    """A payload of other shapes under this call's own key (a bug, or a hand-made file):
    refused before the first call, so the donated argument is still alive."""
    _store_call(tmp_path, donate_argnums=(0,))
    (path,) = tmp_path.glob(f"*{program_store.FILE_SUFFIX}")
    header = json.loads(path.read_bytes()[len(program_store.FILE_MAGIC):].split(b"\n", 1)[0])
    other = jax.export.export(jax.jit(_add))(jnp.ones(4), jnp.ones(4)).serialize()
    header.update(payload_bytes=len(other), payload_sha256=__import__("hashlib").sha256(other).hexdigest())
    path.write_bytes(program_store.FILE_MAGIC + json.dumps(header).encode() + b"\n" + bytes(other))
    x = jnp.ones(3)
    with caplog.at_level(logging.WARNING):
        again, out = _store_call(tmp_path, args=(x, jnp.ones(3)), donate_argnums=(0,))
    assert "does not fit the call" in caplog.text and again.store.num_loaded == 0
    np.testing.assert_array_equal(out, 2.0)


def test_untrusted_directories_are_named(tmp_path):
    trusted = tmp_path / "mine"
    assert trusted_directory.make_private_directory(trusted / "a" / "b") is None
    assert (trusted / "a" / "b").stat().st_mode & 0o777 == 0o700
    for mode in (0o770, 0o707):
        loose = tmp_path / f"loose{mode:o}"
        loose.mkdir()
        loose.chmod(mode)
        assert "writable by group or others" in trusted_directory.untrusted_directory_reason(loose)
        assert "ancestor" in trusted_directory.untrusted_directory_reason(loose / "child")
        assert trusted_directory.make_private_directory(loose / "child") is not None
    if os.getuid() == 0:  # root can hand a directory to another user
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 12345, 12345)
        assert "owned by uid 12345" in trusted_directory.untrusted_directory_reason(foreign)


@pytest.fixture
def jax_cache_config():
    """JAX's persistent-cache options, turned on for the test and restored after it (the
    test process otherwise keeps the cache off: conftest.py)."""
    from jax._src import compilation_cache

    names = ("jax_enable_compilation_cache", "jax_compilation_cache_dir",
             "jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes")
    saved = {name: getattr(jax.config, name) for name in names}
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", None)
    yield
    for name, value in saved.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


def test_an_untrusted_cache_directory_turns_the_cache_and_the_store_off(jax_cache_config, tmp_path):
    model = LlamaForCausalLM(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    loose = tmp_path / "shared"
    loose.mkdir()
    loose.chmod(0o777)
    engine = LLMEngine(model, dataclasses.replace(CONFIG, compilation_cache_dir=str(loose / "xla")))
    assert "compilation cache: off, program store off" in engine.start_report
    assert "writable by group or others" in engine.start_report
    assert engine.runner.program_store is None and jax.config.jax_compilation_cache_dir is None


def test_the_cache_directory_expands_home_and_a_second_differing_one_raises(jax_cache_config, tmp_path,
                                                                            monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    line = startup.use_compilation_cache(dataclasses.replace(CONFIG, compilation_cache_dir="~/jaxcache"))
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "jaxcache") and str(tmp_path) in line
    assert (tmp_path / "jaxcache").is_dir() and not (pathlib.Path.cwd() / "~").exists()
    assert startup.program_store_dir(CONFIG) == str(tmp_path / "jaxcache" / "jax_paged_attn_programs")
    with pytest.raises(ValueError, match="compilation_cache_dir"):
        startup.use_compilation_cache(dataclasses.replace(CONFIG, compilation_cache_dir=str(tmp_path / "b")))
    startup.use_compilation_cache(dataclasses.replace(CONFIG, compilation_cache_dir=str(tmp_path / "jaxcache")))


def _files_by_call(directory: pathlib.Path) -> dict[tuple[str, str], pathlib.Path]:
    """The store's files by their program and call lines (from their headers)."""
    found = {}
    for path in directory.glob(f"*{program_store.FILE_SUFFIX}"):
        header = json.loads(path.read_bytes()[len(program_store.FILE_MAGIC):].split(b"\n", 1)[0])
        lines = [line for line in header["key"] if line.startswith(("program ", "call "))]
        found[tuple(lines)] = path
    return found


def test_a_program_of_another_model_under_the_base_models_name_is_not_loaded(monkeypatch, tmp_path, caplog):
    """Files of the same calls from a model with another rope_theta (same shapes) and
    one with another intermediate size, copied over the base model's files: none is
    loaded, each is said, and the base model's tokens come out."""
    directory_of_run = []
    monkeypatch.setattr(startup, "program_store_dir", lambda config: str(tmp_path / directory_of_run[-1]))
    prompts = random_prompts(3, (7, 12))

    def run(model_config, directory):
        directory_of_run.append(directory)
        engine = LLMEngine(LlamaForCausalLM(model_config, rngs=nnx.Rngs(0)), CONFIG)
        tokens = [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)]
        return engine.runner.program_store, tokens

    base_store, base_tokens = run(LlamaConfig.tiny(), "base")
    run(LlamaConfig.tiny(rope_theta=1234.0), "rope")
    run(LlamaConfig.tiny(intermediate_size=2 * LlamaConfig.tiny().intermediate_size), "shapes")
    base, others = _files_by_call(tmp_path / "base"), [_files_by_call(tmp_path / d) for d in ("rope", "shapes")]
    planted = 0
    for i, (call, path) in enumerate(sorted(base.items())):
        source = others[i % 2].get(call) or others[1 - i % 2].get(call)
        if source is not None:
            shutil.copyfile(source, path)
            planted += 1
    assert planted >= 2 and base_store.num_stored == len(base)
    with caplog.at_level(logging.WARNING):
        store, tokens = run(LlamaConfig.tiny(), "base")
    assert tokens == base_tokens
    assert store.num_loaded == len(base) - planted and store.num_stored == planted
    assert caplog.text.count("it holds another program") == planted


def test_a_warm_start_prefetches_its_own_configurations_programs_in_their_order(tmp_path):
    """The programs a warm-up used are listed under its configuration (`write_manifest`);
    the next `prefetch` under that configuration reads those, in that order, and no other
    configuration's; with no list (or a list naming anything but the store's program
    files) it reads every program of the key, as before."""
    device = jax.devices()[0]
    store = program_store.ProgramStore(tmp_path, ["shared"], device=device)
    programs = {n: program_store.StoredProgram(jax.jit(lambda x, n=n: x * n), f"times{n}", store, params_first=False)
                for n in range(1, 6)}
    for n in (3, 1, 2):
        programs[n](jnp.ones(n))
    store.write_manifest(["engine a"])
    store.used.clear()
    for n in (4, 5):
        programs[n](jnp.ones(n))
    store.write_manifest(["engine b"])
    names = {n: store._path(f"times{n}", program_store.call_signature((jnp.ones(n),), {})).name for n in programs}

    def prefetched(lines):
        fresh = program_store.ProgramStore(tmp_path, ["shared"], device=device)
        return fresh.prefetch({}, lines), fresh.prefetched_from_manifest, [p.name for p in fresh._prefetched]

    assert prefetched(["engine a"]) == (3, True, [names[3], names[1], names[2]])
    assert prefetched(["engine b"]) == (2, True, [names[4], names[5]])
    assert prefetched(["engine c"]) == (5, False, sorted(names.values()))
    store._write_value("manifest", ["engine d"], ["../../etc/passwd", names[1]])
    assert prefetched(["engine d"])[:2] == (5, False)
    again = program_store.ProgramStore(tmp_path, ["shared"], device=device)
    again.prefetch({}, ["engine a"])
    reread = program_store.StoredProgram(jax.jit(lambda x: x * 3), "times3", again, params_first=False)
    np.testing.assert_array_equal(reread(jnp.ones(3)), 3.0)
    assert again.num_prefetched == again.num_loaded == 1 and again.num_stored == 0


_ENGINE_SCRIPT = """
import json, sys
import jax
from flax import nnx
import jax_paged_attn
from jax_paged_attn.engine import EngineConfig, LLMEngine, SamplingParams
from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM
assert jax_paged_attn.__file__.startswith(sys.argv[1]), jax_paged_attn.__file__
engine = LLMEngine(LlamaForCausalLM(LlamaConfig.tiny(), rngs=nnx.Rngs(0)),
                   EngineConfig(num_blocks=32, max_num_seqs=2, max_num_batched_tokens=32, batch_buckets=(2,),
                                token_buckets=(32,), block_table_width_buckets=(4,), max_model_len=64,
                                compilation_cache_dir=sys.argv[2],
                                compiler_options={"xla_backend_optimization_level": 0}))
outs = engine.generate([[1, 2, 3, 4, 5], [7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
store = engine.runner.program_store
print(json.dumps(dict(tokens=[o.outputs[0].token_ids for o in outs], loaded=store.num_loaded,
                      prefetched=store.num_prefetched, stored=store.num_stored, traces=engine.runner.num_traces)))
"""


# The child processes run on the CPU on every host: on a GPU host this process has
# already taken most of the GPU's memory (JAX preallocates it), and what is tested, the
# store's files across processes, does not depend on the backend (tests/test_engine_gpu.py
# loads compiled GPU programs from the store).
_CHILD_ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _run_engine_process(package_root: pathlib.Path, cache: pathlib.Path) -> dict:
    done = subprocess.run([sys.executable, "-c", _ENGINE_SCRIPT, str(package_root), str(cache)],
                          capture_output=True, text=True, env={**_CHILD_ENV, "PYTHONPATH": str(package_root)},
                          cwd=package_root, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_starts_after_an_upgrade_load_what_they_stored(tmp_path):
    """Issue #49 item 1, in separate processes: start, change a source file of the
    package (an upgrade), start, start again: each start exits 0 with the same tokens,
    and the last one loads every program without tracing, each read and compiled ahead
    by the store's prefetch (the upgraded start prefetches none of the old key's)."""
    root = tmp_path / "copy"
    shutil.copytree(REPO / "jax_paged_attn", root / "jax_paged_attn",
                    ignore=shutil.ignore_patterns("__pycache__"))
    cache = tmp_path / "cache"
    first = _run_engine_process(root, cache)
    with open(root / "jax_paged_attn" / "engine" / "__init__.py", "a") as f:
        f.write("\n# upgraded\n")
    second = _run_engine_process(root, cache)
    third = _run_engine_process(root, cache)
    assert first["tokens"] == second["tokens"] == third["tokens"]
    assert second["loaded"] == second["prefetched"] == 0 and second["stored"] == first["stored"] > 0
    assert third["loaded"] == third["prefetched"] == first["stored"] and third["stored"] == 0
    assert third["traces"] == 0


_WRITER_SCRIPT = """
import sys
import jax, jax.numpy as jnp
jax.config.update("jax_enable_compilation_cache", False)
from jax_paged_attn.engine import program_store
store = program_store.ProgramStore(sys.argv[1], ["shared"])
for n in range(1, 6):
    stored = program_store.StoredProgram(jax.jit(lambda x: x * 2), f"double{n}", store, params_first=False)
    assert float(stored(jnp.ones(n)).sum()) == 2 * n
print(store.num_loaded, store.num_stored)
"""


def test_two_processes_writing_one_directory_at_once_leave_whole_files(tmp_path):
    runs = [subprocess.Popen([sys.executable, "-c", _WRITER_SCRIPT, str(tmp_path)], cwd=REPO, env=_CHILD_ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for run in runs:
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err[-3000:]
    assert not list(tmp_path.glob("*.tmp"))
    done = subprocess.run([sys.executable, "-c", _WRITER_SCRIPT, str(tmp_path)], cwd=REPO, env=_CHILD_ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["5", "0"], done.stderr[-3000:]


def test_a_stored_program_with_a_mosaic_gpu_kernel_imports_its_lowering_before_it_compiles(tmp_path, monkeypatch):
    """A process that compiles a stored program traced none of its kernels, so nothing
    imported JAX's Mosaic GPU module, which names the runtime library XLA links the
    kernel's host code against: every compile of a stored program first hands its module to
    `dispatch.prepare_lowering_runtimes`, which asks for the Mosaic GPU lowering (its
    import) where a Mosaic GPU kernel is in the module (a real one, exported for CUDA)
    and for nothing elsewhere. tests/test_engine_gpu.py runs such programs in a fresh
    process on a GPU."""
    from conftest import cuda_lowering_target
    from jax_paged_attn import dispatch

    cache = jnp.zeros((12, 16, 2, 64), jnp.bfloat16)
    lens, table = jnp.array([5, 17, 40], jnp.int32), jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
    decode = jax.jit(lambda q, k, v, n, t: jpa.flash_attn_with_kvcache(q, k, v, n, t, causal=True,
                                                                      implementation="mosaic_gpu"))
    with cuda_lowering_target():
        kernel = jax.export.export(decode, platforms=("cuda",))(jnp.ones((3, 1, 8, 64), jnp.bfloat16), cache, cache,
                                                                 lens, table)
    plain = jax.export.export(jax.jit(lambda x: x * 3))(jnp.ones(3))
    asked = []
    monkeypatch.setattr(dispatch, "lowering_unavailable_reason", asked.append)
    dispatch.prepare_lowering_runtimes(plain.mlir_module_serialized)
    assert asked == []
    dispatch.prepare_lowering_runtimes(kernel.mlir_module_serialized)
    assert asked == [dispatch.MOSAIC_GPU]

    prepared = []
    monkeypatch.setattr(dispatch, "prepare_lowering_runtimes", prepared.append)
    for _ in range(2):  # stored (compiled as the next start will), then read back
        store = program_store.ProgramStore(tmp_path, ["shared"])
        times3 = program_store.StoredProgram(jax.jit(lambda x: x * 3), "times3", store, params_first=False)
        np.testing.assert_array_equal(times3(jnp.ones(3)), 3.0)
    assert store.num_stored == 0 and store.num_loaded == 1
    assert len(prepared) == 2 and all(m.startswith(b"ML\xefR") for m in prepared)  # MLIR bytecode
