"""Tensor parallelism (`jax_paged_attn.parallel`): sharded model == single-device model.

The equivalence test needs several devices: it runs this file as a subprocess on the CPU
with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``, a flag JAX reads only when
it starts (so it cannot be set inside a pytest process that already initialized JAX, and
must not leak into the other tests). The subprocess runs `_equivalence_main` and checks,
for 2-, 4- and 8-way tensor parallelism, that logits and KV caches equal the single-
device ones through a chunked prefill and decode steps, that parameters and caches
are laid out as documented (4-way with ``--full`` only: 2- and 8-way already hold several
KV heads a device and one), that loading a checkpoint reads each device's slices, and
that copy-on-write and swapping keep caches sharded by KV head (`_check_sharded_cache_ops`).
Other subprocesses check KV-head replication (`_replication_main`) and the engine
(`_engine_main`).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_paged_attn import parallel

NUM_HOST_DEVICES = 8
TP_SIZES_VARIABLE = "JPA_TEST_TP_SIZES"  # the tensor-parallel sizes the subprocess checks
INIT_DUMP_VARIABLE = "JPA_TEST_INIT_HLO_DIR"  # where XLA writes the sharded init's compiled HLO
INIT_PROGRAM = "init_sharded_parameters"  # `parallel.init_sharded`'s jitted function
COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_param_partition_specs_follow_megatron_layout():
    spec = lambda *path, shape=(64, 128): parallel.param_partition_spec(  # noqa: E731
        path, shape, axis_name="tp", tp_size=4)
    # Fused q/k/v [hidden, Hk, Hq/Hk + 2, D]: sharded by KV head, each device's GQA groups whole.
    qkv = ("model", "layers", 0, "self_attn", "qkv_proj", "kernel")
    assert spec(*qkv, shape=(64, 8, 4, 32)) == P(None, "tp", None, None)
    assert spec(*qkv, shape=(64, 2, 10, 32)) == P()  # 2 KV heads over 4 devices: replicated
    # Fused gate / up [hidden, 2, intermediate]: sharded on the intermediate axis.
    gate_up = ("model", "layers", 0, "mlp", "gate_up_proj", "kernel")
    assert spec(*gate_up, shape=(64, 2, 128)) == P(None, None, "tp")
    assert spec(*gate_up, shape=(64, 2, 130)) == P()  # intermediate not divisible: replicated
    assert spec("model", "layers", 3, "self_attn", "o_proj", "kernel") == P("tp", None)
    assert spec("model", "layers", 3, "mlp", "down_proj", "kernel") == P("tp", None)
    assert spec("lm_head", "kernel") == P(None, "tp")
    assert spec("lm_head", "kernel", shape=(64, 130)) == P()  # vocabulary not divisible: replicated
    assert spec("model", "embed_tokens", "embedding") == P()
    assert spec("model", "norm", "weight", shape=(64,)) == P()
    assert parallel.kv_cache_spec("tp") == P(None, None, None, "tp", None)


def test_kv_head_replicas_and_the_replicated_qkv_layout():
    assert parallel.kv_head_replicas(16, 8, 2) == 1 and parallel.kv_head_replicas(8, 2, 4) == 2
    assert parallel.kv_head_replicas(8, 1, 8) == 8 and parallel.kv_head_replicas(4, 4, 4) == 1
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) divisible by 4"):
        parallel.kv_head_replicas(6, 2, 4)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\) is smaller than the tensor-parallel size 4"):
        parallel.kv_head_replicas(12, 3, 4)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(6\) divisible by 4"):
        parallel.kv_head_replicas(12, 6, 4)
    # Hq=8, Hk=2 at tp=4: stored KV head e (device e) is KV head e // 2 with query heads 2e, 2e + 1,
    # and query head h's KV head is h // (Hq / Hk) = h // 4: each device's queries use its KV head.
    hq, hk, replicas = 8, 2, 2
    group = hq // hk
    sources = parallel.replicated_qkv_sources(hq, hk, replicas)  # [4, 2 + 2], flat (KV head, slot)
    kv_head, slot = sources // (group + 2), sources % (group + 2)
    local_group = group // replicas
    for e in range(hk * replicas):
        assert (kv_head[e] == e // replicas).all()
        queries = kv_head[e, :local_group] * group + slot[e, :local_group]
        assert queries.tolist() == list(range(e * local_group, (e + 1) * local_group))
        assert {q // group for q in queries} == {e // replicas}
        assert slot[e, local_group:].tolist() == [group, group + 1]  # its key, its value
    kernel = np.random.default_rng(0).standard_normal((3, hk, group + 2, 5)).astype(np.float32)
    replicated = parallel.replicate_kv_heads(kernel, hq, replicas)
    assert replicated.shape == (3, hk * replicas, local_group + 2, 5)
    np.testing.assert_array_equal(replicated[:, 1, local_group], kernel[:, 0, group])  # copy 1 of key 0
    np.testing.assert_array_equal(np.asarray(parallel.replicate_kv_heads(jnp.asarray(kernel), hq, replicas)),
                                  replicated)


@pytest.mark.parametrize("replicas", [1, 2])
def test_shard_reads_assemble_every_parameter_shard(replicas):
    """`HFTensorPlacement.read_shard` at 2- and 4-way: each shard of each parameter, from
    the slices it reads, equals that box of the whole parameter `to_part` builds; the
    reads of a sharded tensor split it (nothing read twice) but for replicated KV heads."""
    from flax import nnx

    from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM
    from jax_paged_attn.models.checkpoint import hf_parameter_map

    config = LlamaConfig.tiny(num_attention_heads=8, num_key_value_heads=2)
    model = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    shapes = {path: tuple(var.get_value().shape) for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    qkv = ("model", "layers", 0, "self_attn", "qkv_proj", "kernel")
    group = config.num_attention_heads // config.num_key_value_heads
    for layer in range(config.num_hidden_layers):
        shapes[qkv[:2] + (layer,) + qkv[3:]] = (64, 2 * replicas, group // replicas + 2, 32)
    placements = hf_parameter_map(config, kv_head_replicas=replicas)
    rng = np.random.default_rng(1)
    tensors = {name: rng.standard_normal(p.hf_shape(shapes[p.param_path])).astype(np.float32)
               for name, p in placements.items()}
    params = {path: np.full(shape, np.nan, np.float32) for path, shape in shapes.items()}
    for name, p in placements.items():
        params[p.param_path][p.index] = p.to_part(tensors[name], shapes[p.param_path])

    class Recorded:
        def __init__(self, array):
            self.array, self.read = array, 0

        def __getitem__(self, index):
            out = self.array[index]
            self.read += out.size
            return out

    for tp in (2, 4) if replicas == 1 else (4,):
        views = {name: Recorded(t) for name, t in tensors.items()}
        for path, shape in shapes.items():
            spec = parallel.param_partition_spec(path, shape, axis_name="tp", tp_size=tp)
            sharded = [axis for axis, name in enumerate(spec) if name is not None]
            for d in range(tp if sharded else 1):
                box = tuple(slice(d * n // tp, (d + 1) * n // tp) if axis in sharded else slice(None)
                            for axis, n in enumerate(shape))
                shard = np.full(params[path][box].shape, np.nan, np.float32)
                for name, p in placements.items():
                    found = p.param_path == path and p.read_shard(views[name], shape, box)
                    if found:
                        shard[found[0]] = found[1]
                np.testing.assert_array_equal(shard, params[path][box], err_msg=f"{path} tp={tp} shard {d}")
        for name, view in views.items():
            copies = replicas if re.search(r"\.(k|v)_proj", name) else 1
            assert view.read == tensors[name].size * copies, (name, tp, view.read)


def test_bad_configurations_raise():
    with pytest.raises(ValueError, match="divisible by 4"):
        parallel.check_head_divisibility(8, 2, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        parallel.tensor_parallel_mesh(len(jax.devices()) + 1)
    mesh = parallel.tensor_parallel_mesh(1)
    with pytest.raises(ValueError, match="no axis 'model'"):
        parallel.kv_cache_sharding(mesh, "model")
    with pytest.raises(TypeError, match="Mesh"):
        parallel.param_sharding(("lm_head", "kernel"), (4, 4), "not a mesh")


def test_one_device_mesh_runs_attention_under_shard_map():
    # Exercises head_parallel's plumbing in-process (1 device), alibi slopes and scales included.
    mesh = parallel.tensor_parallel_mesh(1)
    seen = {}

    def attention(q, k, v, cache, meta, slopes, k_scale, v_scale, *, num_heads, num_kv_heads):
        seen.update(num_heads=num_heads, num_kv_heads=num_kv_heads)
        return q * slopes.sum() * k_scale * v_scale + meta["x"], cache

    fn = parallel.head_parallel(attention, mesh=mesh, num_heads=4, num_kv_heads=2)
    q = jnp.ones((3, 4 * 32))
    out, cache = fn(q, jnp.ones((3, 64)), jnp.ones((3, 64)), jnp.zeros((2, 1, 16, 2, 32)), {"x": jnp.float32(1.0)},
                    jnp.full((4,), 0.5), 2.0, 3.0)
    assert seen == {"num_heads": 4, "num_kv_heads": 2}
    np.testing.assert_allclose(np.asarray(out), 13.0)
    assert cache.shape == (2, 1, 16, 2, 32)


def test_one_device_mesh_runs_the_fused_rotary_cache_write_under_shard_map():
    # kv_head_parallel's plumbing in-process (1 device): the fused op's result is unchanged.
    from jax_paged_attn import cache

    mesh = parallel.tensor_parallel_mesh(1)
    rng = np.random.default_rng(0)
    qkv = jnp.asarray(rng.standard_normal((5, 2, 4, 32)), jnp.float32)
    cos, sin = jnp.asarray(rng.standard_normal((2, 5, 32)), jnp.float32)
    kv = jnp.zeros((2, 2, 16, 2, 32), jnp.float32)
    slots = jnp.asarray([0, 3, -1, 17, 30], jnp.int32)
    def write(qkv, cos, sin, kv, slots, k_scale, v_scale):
        return cache.rotary_and_cache_flash_kv(qkv, cos, sin, kv, slots, "auto", k_scale, v_scale)

    want = jax.jit(write)(qkv, cos, sin, kv, slots, 1.0, 1.0)
    got = jax.jit(parallel.kv_head_parallel(write, mesh=mesh))(qkv, cos, sin, kv, slots, 1.0, 1.0)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_sharded_init_in_several_programs_gives_the_single_device_values(monkeypatch):
    # In-process (a 1-device mesh): parameters drawn by several programs, rngs advanced as
    # a plain build advances them.
    from flax import nnx

    from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.tiny(num_hidden_layers=1)
    monkeypatch.setattr(parallel, "INIT_PROGRAM_BYTES", 100_000)  # 3 programs of this model's 260 kB
    programs, consecutive_parts = [], parallel._consecutive_parts

    def recorded_parts(sizes, budget):
        programs.extend(consecutive_parts(sizes, budget))
        return programs

    monkeypatch.setattr(parallel, "_consecutive_parts", recorded_parts)
    want_rngs, got_rngs = nnx.Rngs(0), nnx.Rngs(0)
    want = LlamaForCausalLM(config, rngs=want_rngs, implementation="xla")
    got = LlamaForCausalLM(config, rngs=got_rngs, implementation="xla", mesh=parallel.tensor_parallel_mesh(1))
    assert len(programs) == 3, programs
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(want)), nnx.to_flat_state(nnx.state(got))):
        np.testing.assert_array_equal(np.asarray(b.get_value()), np.asarray(a.get_value()), err_msg=str(path))
    assert jax.random.key_data(got_rngs.params()).tolist() == jax.random.key_data(want_rngs.params()).tolist()


def _run_on_host_devices(part: str, env_changes: dict[str, str]) -> str:
    """Runs this file's ``part`` (`_equivalence_main`, `_replication_main` or
    `_engine_main`) in a subprocess with `NUM_HOST_DEVICES` forced CPU devices; returns
    its stdout."""
    env = dict(os.environ, **env_changes)
    force_devices = f"--xla_force_host_platform_device_count={NUM_HOST_DEVICES}"
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + force_devices).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    result = subprocess.run([sys.executable, os.path.abspath(__file__), part], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, f"subprocess failed:\n{result.stdout}\n{result.stderr[-6000:]}"
    return result.stdout


def test_sharded_model_matches_single_device(request):
    """2- and 8-way (several KV heads a device, one); 4-way too with ``--full``."""
    sizes = (2, 4, 8) if request.config.getoption("--full") else (2, 8)
    out = _run_on_host_devices("equivalence", {TP_SIZES_VARIABLE: ",".join(map(str, sizes))})
    assert "checked " + " ".join(f"tp={tp}" for tp in sizes) in out, out


def test_replicated_kv_heads_match_single_device():
    """Fewer KV heads than devices, in a process of its own (`_replication_main`)."""
    out = _run_on_host_devices("replication", {})
    assert "checked tp=4 with 2 KV heads, tp=2 with 1 KV heads" in out, out


def test_sharded_engine_matches_single_device(tmp_path):
    """The engine at 2-way (`_engine_main`), in a process of its own: the pytest-xdist
    workers run it beside the model's equivalence. XLA dumps the compiled program that
    creates the sharded model's parameters, for the subprocess to read."""
    dump = f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*{INIT_PROGRAM}.*"
    out = _run_on_host_devices("engine", {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {dump}",
                                          INIT_DUMP_VARIABLE: str(tmp_path)})
    assert "checked the engine at tp=2" in out, out


# --------------------------------------------------------------------------- the subprocess

_BLOCK_SIZE, _NUM_BLOCKS = 16, 16


def _paged_generate(model):
    """A chunked prefill (first 13 tokens, then the rest with a decode), then 2 decode steps
    of two prompts -> (each step's logits, the caches, the prompts with greedy tokens)."""
    from jax_paged_attn.builder import FlashAttentionMetadataBuilder, ScheduledSequence, input_positions, pack_per_token
    from jax_paged_attn.models import last_token_indices
    from jax_paged_attn.models.llama import jit_forward

    builder = FlashAttentionMetadataBuilder(block_size=_BLOCK_SIZE, num_blocks=_NUM_BLOCKS, chunked_prefill=True)
    prompts = [list(range(3, 24)), [7, 1, 9, 4, 4]]
    tables = [[5, 2], [11]]
    forward, caches = jit_forward(model), model.allocate_kv_caches(_NUM_BLOCKS, _BLOCK_SIZE)
    tokens = [list(p) for p in prompts]
    plan = [[(0, 13), (0, 5)], [(13, 8), (5, 1)], [(21, 1), (6, 1)], [(22, 1), (7, 1)]]
    all_logits = []
    for step in plan:
        seqs = [ScheduledSequence(is_prompt=n > 1 or ctx == 0, seq_len=ctx + n, context_len=ctx, query_len=n,
                                  block_table=table) for (ctx, n), table in zip(step, tables)]
        md = builder.build(seqs)
        ids = pack_per_token(md, seqs, [t[ctx:ctx + n] for t, (ctx, n) in zip(tokens, step)])
        logits, caches = forward(jnp.asarray(ids), jnp.asarray(input_positions(md, seqs)), caches, md,
                                 last_token_indices(md))
        all_logits.append(np.asarray(logits))
        real = [int(r) for r in np.nonzero(np.asarray(md.seq_lens))[0]]
        for seq, row in enumerate(real):
            ctx, n = step[seq]
            if ctx + n == len(tokens[seq]):
                tokens[seq].append(int(np.argmax(all_logits[-1][row])))
    return all_logits, caches, tokens


def _record_safetensors_reads() -> list[tuple[str, str, tuple[int, ...]]]:
    """Wraps `safetensors.safe_open` (which the checkpoint loader opens files with) so
    that every tensor read is appended to the returned list as ``(how, name, shape)``:
    how is "slice" (``get_slice(name)[...]``, reading only those bytes) or "whole"
    (``get_tensor``). Header reads (shapes, dtypes) are not reads."""
    import safetensors

    reads: list[tuple[str, str, tuple[int, ...]]] = []
    open_file = safetensors.safe_open

    class Slice:
        def __init__(self, name, view):
            self.name, self.view = name, view

        def __getitem__(self, index):
            out = self.view[index]
            reads.append(("slice", self.name, tuple(out.shape)))
            return out

        def __getattr__(self, attribute):  # get_shape, get_dtype
            return getattr(self.view, attribute)

    class File:
        def __init__(self, *args, **kwargs):
            self.file = open_file(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_slice(self, name):
            return Slice(name, self.file.get_slice(name))

        def get_tensor(self, name):
            out = self.file.get_tensor(name)
            reads.append(("whole", name, tuple(out.shape)))
            return out

    safetensors.safe_open = File
    return reads


def _expected_shard_reads(config, tp: int) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """The reads a tp-way load makes of each tensor: one slice per device of a sharded
    tensor (a row-parallel one split by columns, the others by rows; with KV heads
    replicated, a device's k / v slice is its one KV head), one read of a replicated one."""
    from jax_paged_attn.models.checkpoint import hf_parameter_map

    hidden, d, inter, vocab = config.hidden_size, config.head_dim, config.intermediate_size, config.vocab_size
    hq, hk = config.num_attention_heads, config.num_key_value_heads
    per_device = {"q_proj": (hq * d // tp, hidden), "k_proj": (max(hk // tp, 1) * d, hidden),
                  "v_proj": (max(hk // tp, 1) * d, hidden), "o_proj": (hidden, hq * d // tp),
                  "gate_proj": (inter // tp, hidden), "up_proj": (inter // tp, hidden),
                  "down_proj": (hidden, inter // tp), "lm_head": (vocab // tp, hidden)}
    expected = {}
    for name in hf_parameter_map(config):
        kind = name.split(".")[-2]
        if kind in per_device:
            expected[name] = [("slice", per_device[kind])] * tp
        else:  # embeddings and norms: replicated, read once
            expected[name] = [("slice", (vocab, hidden) if "embed" in name else (hidden,))]
    return expected


def _reads_by_tensor(reads) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    by_tensor: dict[str, list] = {}
    for how, name, shape in reads:
        by_tensor.setdefault(name, []).append((how, shape))
    return by_tensor


def _check_sharded_cache_ops(cache: jax.Array, mesh) -> None:
    """Copy-on-write and swapping on a layer's cache sharded by KV head: eager and under
    `jax.jit` with the destination donated, the results equal the ops on the gathered
    cache and keep the KV-head sharding (nothing gathered to one device), and donation
    reuses the buffers (a warning says when it cannot: an error here)."""
    import warnings

    from jax_paged_attn import cache as cache_ops

    sharding = parallel.kv_cache_sharding(mesh)
    whole = np.asarray(cache)
    num_blocks = whole.shape[1]

    def on_mesh(x):  # a fresh sharded buffer (a device_put of NumPy may alias it: no donation)
        return jax.jit(lambda x: x + 0, out_shardings=sharding)(jnp.asarray(x))

    def check(got, want, what):
        assert got.sharding.is_equivalent_to(sharding, got.ndim), (what, got.sharding)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=what)

    copies = np.array([[5, 7], [2, 3], [-1, -1], [11, 0]], np.int32)
    want = whole.copy()
    want[:, copies[[0, 1, 3], 1]] = whole[:, copies[[0, 1, 3], 0]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Some donated buffers were not usable"
        donated = on_mesh(whole)
        (got,) = jax.jit(cache_ops.copy_kv_cache_blocks, donate_argnums=0)([donated], copies)
        assert donated.is_deleted()
        check(got, want, "copy_kv_cache_blocks under jit, donated")
        (got,) = cache_ops.copy_kv_cache_blocks([on_mesh(whole)], copies)
        check(got, want, "copy_kv_cache_blocks eagerly")

        moves = np.array([[5, 1], [2, 0], [11, 3]], np.int32)
        want = np.zeros_like(whole)
        want[:, moves[:, 1]] = whole[:, moves[:, 0]]
        donated = on_mesh(np.zeros_like(whole))
        got = jax.jit(cache_ops.swap_blocks, donate_argnums=1)(on_mesh(whole), donated, moves)
        assert donated.is_deleted()
        check(got, want, "swap_blocks device -> device under jit, donated")
        # Out to host memory and back in: the swap-in lands sharded on the devices.
        host = cache_ops.allocate_host_kv_cache(num_blocks, whole.shape[2], whole.shape[3], whole.shape[4],
                                                kv_cache_dtype="auto", model_dtype=whole.dtype)
        host = cache_ops.swap_blocks(on_mesh(whole), host, moves)
        donated = on_mesh(np.zeros_like(whole))
        got = cache_ops.swap_blocks(host, donated, moves[:, [1, 1]])  # host block b -> device block b
        assert donated.is_deleted()
        check(got, want, "swap_blocks host -> sharded device, eagerly")


def count_collectives(hlo: str) -> dict[str, int]:
    """Collective ops in compiled HLO text: name -> count (an async pair counts once)."""
    found = COLLECTIVE.findall(hlo)
    return {name: found.count(name) for name in set(found)}


def gathered_shapes(hlo: str) -> list[str]:
    """The result shape of every all-gather in compiled HLO text, e.g. ``"f32[4,2]"``."""
    return re.findall(r"= (\S+?)(?:\{[^}]*\})? all-gather(?:-start)?\(", hlo)


def _equivalence_main() -> None:
    from flax import nnx

    from jax_paged_attn.builder import FlashAttentionMetadataBuilder, ScheduledSequence
    from jax_paged_attn.layer import PagedAttention
    from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM, last_token_indices, load_llama, save_checkpoint

    assert len(jax.devices()) == NUM_HOST_DEVICES, jax.devices()
    block_size, num_blocks = _BLOCK_SIZE, _NUM_BLOCKS
    config = LlamaConfig.tiny(num_attention_heads=16, num_key_value_heads=8)  # 8 KV heads: up to 8-way
    reference = LlamaForCausalLM(config, rngs=nnx.Rngs(0), implementation="xla")
    builder = FlashAttentionMetadataBuilder(block_size=block_size, num_blocks=num_blocks, chunked_prefill=True)
    generate = _paged_generate
    reads = _record_safetensors_reads()

    def collectives(model):
        """Collective ops in the compiled decode step of ``model``: name -> count."""
        graphdef, state = nnx.split(model)
        seqs = [ScheduledSequence(is_prompt=False, seq_len=9, context_len=8, query_len=1, block_table=[b])
                for b in range(2)]
        md = builder.build(seqs)
        ids = jnp.zeros((md.num_tokens,), jnp.int32)

        def step(state, ids, caches, md):
            return nnx.merge(graphdef, state)(ids, ids, caches, md, logits_indices=last_token_indices(md))

        return count_collectives(
            jax.jit(step).lower(state, ids, model.allocate_kv_caches(num_blocks, block_size), md).compile().as_text())

    want_logits, want_caches, want_tokens = generate(reference)
    checked = []
    with tempfile.TemporaryDirectory() as directory:
        save_checkpoint(reference, config, directory)
        for tp in map(int, os.environ.get(TP_SIZES_VARIABLE, "2,4,8").split(",")):
            mesh = parallel.tensor_parallel_mesh(tp)
            reads.clear()
            model = load_llama(directory, dtype=jnp.float32, implementation="xla", mesh=mesh)
            # Each device read its own slice of each sharded tensor; replicated ones were read once.
            assert _reads_by_tensor(reads) == _expected_shard_reads(config, tp), (tp, reads)
            for (path, got), (_, want) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                                              nnx.to_flat_state(nnx.state(reference, nnx.Param))):
                np.testing.assert_array_equal(np.asarray(got.get_value()), np.asarray(want.get_value()),
                                              err_msg=f"tp={tp} {path}")
            layer0 = model.model.layers[0]

            def laid_out(array, spec):
                return array.sharding.is_equivalent_to(NamedSharding(mesh, spec), array.ndim)

            qkv_kernel = layer0.self_attn.qkv_proj.kernel.get_value()  # [hidden, Hk, group + 2, D]
            assert laid_out(qkv_kernel, P(None, "tp", None, None))
            assert len(qkv_kernel.addressable_shards) == tp
            assert qkv_kernel.addressable_shards[0].data.shape[1] == config.num_key_value_heads // tp
            assert laid_out(layer0.mlp.gate_up_proj.kernel.get_value(), P(None, None, "tp"))
            assert laid_out(layer0.self_attn.o_proj.kernel.get_value(), P("tp", None))
            assert laid_out(layer0.mlp.down_proj.kernel.get_value(), P("tp", None))
            assert laid_out(model.model.embed_tokens.embedding.get_value(), P())
            # The fused q/k/v output is split by KV head like the attention shards read it, so
            # the only collectives are the all-reduces of o_proj and down_proj in each layer.
            assert collectives(model) == {"all-reduce": 2 * config.num_hidden_layers}, (tp, collectives(model))
            got_logits, got_caches, got_tokens = generate(model)
            assert laid_out(got_caches[0], P(None, None, None, "tp", None))
            assert got_caches[0].addressable_shards[0].data.shape[3] == config.num_key_value_heads // tp
            assert got_tokens == want_tokens, (tp, got_tokens, want_tokens)
            for step, (got, want) in enumerate(zip(got_logits, want_logits)):
                np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=f"tp={tp} step {step}")
            for layer, (got, want) in enumerate(zip(got_caches, want_caches)):
                # Layer 1's keys depend on layer 0's all-reduced o_proj / down_proj: summation order.
                np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5,
                                           err_msg=f"tp={tp} cache of layer {layer}")
            if tp == 2:
                _check_sharded_cache_ops(got_caches[0], mesh)
                _check_llm_front_end(directory, want_tokens)
            checked.append(f"tp={tp}")

    # The layer alone with ALiBi: slopes are split by head with the queries.
    mesh = parallel.tensor_parallel_mesh(4)
    slopes = [2.0 ** -(h + 1) for h in range(16)]
    kw = dict(num_heads=16, head_size=32, num_kv_heads=8, alibi_slopes=slopes, implementation="xla")
    seqs = [ScheduledSequence.prompt(9, [3], context_len=0)]
    md = FlashAttentionMetadataBuilder(block_size=block_size, chunked_prefill=True).build(seqs)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((md.num_tokens, h * 32)), jnp.float32) for h in (16, 8, 8))
    cache = jnp.zeros((2, 4, block_size, 8, 32), jnp.float32)
    want, want_cache = PagedAttention(**kw)(q, k, v, cache, md)
    got, got_cache = jax.jit(PagedAttention(mesh=mesh, **kw).__call__)(q, k, v, cache, md)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got_cache), np.asarray(want_cache))
    print("checked " + " ".join(checked))


def _check_llm_front_end(directory: str, want_tokens: list[list[int]]) -> None:
    """``LLM(dir, tensor_parallel_size=2)`` loads the checkpoint onto a 2-way mesh and
    generates what the single-device model does (`_paged_generate`'s second prompt and
    its 4 greedy tokens)."""
    from jax_paged_attn.engine import LLM, SamplingParams

    llm = LLM(directory, dtype=jnp.float32, implementation="xla", tensor_parallel_size=2, tokenizer=None,
              warmup=False, num_blocks=_NUM_BLOCKS, block_size=_BLOCK_SIZE, max_num_seqs=2,
              compiler_options={"xla_backend_optimization_level": 0})
    assert dict(llm.model.mesh.shape) == {"tp": 2}, llm.model.mesh
    prompt, want = want_tokens[1][:5], want_tokens[1][5:]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=len(want)))
    assert list(out[0].outputs[0].token_ids) == want, (out[0].outputs[0].token_ids, want)


def _replication_main() -> None:
    """Fewer KV heads than devices (2 KV heads at 4-way, 1 at 2-way): each KV head is
    stored tp // Hk times, one stored head a device. A model drawn from the same seed with
    and without the mesh is the same model: greedy tokens, logits and (each stored head
    against its KV head) caches equal; the save writes the files a single-device save
    writes, and loading them reads each device's slices and rebuilds the replicas."""
    from flax import nnx
    from safetensors.numpy import load_file

    from jax_paged_attn.engine import LLMEngine
    from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM, load_llama, save_checkpoint
    from conftest import engine_base

    reads = _record_safetensors_reads()
    checked = []
    for num_kv_heads, tp in ((2, 4), (1, 2)):
        config = LlamaConfig.tiny(num_attention_heads=8, num_key_value_heads=num_kv_heads)
        reference = LlamaForCausalLM(config, rngs=nnx.Rngs(0), implementation="xla")
        mesh = parallel.tensor_parallel_mesh(tp)
        model = LlamaForCausalLM(config, rngs=nnx.Rngs(0), implementation="xla", mesh=mesh)
        replicas = tp // num_kv_heads
        assert model.kv_head_replicas == replicas and model.num_cache_kv_heads == tp and model.config == config
        want_logits, want_caches, want_tokens = _paged_generate(reference)
        got_logits, got_caches, got_tokens = _paged_generate(model)
        assert got_tokens == want_tokens, (tp, got_tokens, want_tokens)
        for step, (got, want) in enumerate(zip(got_logits, want_logits)):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=f"tp={tp} step {step}")
        for layer, (got, want) in enumerate(zip(got_caches, want_caches)):
            assert got.sharding.is_equivalent_to(parallel.kv_cache_sharding(mesh), got.ndim)
            assert {shard.data.shape[3] for shard in got.addressable_shards} == {1}  # one KV head a device
            np.testing.assert_allclose(np.asarray(got), np.repeat(np.asarray(want), replicas, axis=3), rtol=0,
                                       atol=1e-5, err_msg=f"tp={tp} cache of layer {layer}")

        with tempfile.TemporaryDirectory() as single, tempfile.TemporaryDirectory() as sharded:
            save_checkpoint(reference, config, single)
            save_checkpoint(model, config, sharded)
            want_tensors, got_tensors = (load_file(os.path.join(d, "model.safetensors")) for d in (single, sharded))
            assert got_tensors.keys() == want_tensors.keys()
            for name, tensor in want_tensors.items():
                np.testing.assert_array_equal(got_tensors[name], tensor, err_msg=name)
            reads.clear()
            loaded = load_llama(sharded, dtype=jnp.float32, implementation="xla", mesh=mesh)
            assert _reads_by_tensor(reads) == _expected_shard_reads(config, tp), (tp, reads)
            for (path, got), (_, want) in zip(nnx.to_flat_state(nnx.state(loaded, nnx.Param)),
                                              nnx.to_flat_state(nnx.state(model, nnx.Param))):
                got, want = got.get_value(), want.get_value()
                assert got.sharding.is_equivalent_to(want.sharding, got.ndim), (path, got.sharding)
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"tp={tp} {path}")
        # The engine's swap space holds the stored heads, like its device caches.
        engine = LLMEngine(loaded, engine_base())
        host, device = engine._loop.block_moves.host_swap_space()[0], engine.runner.kv_caches[0]
        assert host.shape[2:] == device.shape[2:] == (16, tp, config.head_dim), (host.shape, device.shape)
        checked.append(f"tp={tp} with {num_kv_heads} KV heads")
    print("checked " + ", ".join(checked))


def _engine_main() -> None:
    """The engine on a 2-way mesh.

    * The model built with ``mesh=`` has the single-device model's parameters, bit for
      bit, each laid out by `parallel.param_sharding`, and the program that created them
      (`parallel.init_sharded`, its compiled HLO dumped by XLA) never holds a sharded
      parameter whole: no array of its global shape, nor of the flat 2-D shape its
      initializer draws, appears on a device.
    * Greedy tokens equal the single-device model's through preemption by swapping and
      copy-on-write of shared prefix blocks (the caches sharded by KV head).
    * The compiled decode window and mixed prefill + decode step hold the two
      all-reduces per layer (o_proj, down_proj) and, for the vocabulary-parallel LM
      head, greedy: each argmax's gather of one (max, index) pair per device and row (the
      mixed step has two: its prompts' and its batch rows'); sampling: one gather of the
      logits (`model_runner.whole_vocabulary`). Nothing else moves: no KV cache, no
      weight.
    """
    import dataclasses
    import glob

    from flax import nnx

    from conftest import engine_base, random_prompts
    from jax_paged_attn.engine import LLMEngine, SamplingParams
    from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM, dense_greedy_generate

    # intermediate 192: no replicated parameter shares a sharded one's global shape.
    config = LlamaConfig.tiny(num_attention_heads=16, num_key_value_heads=8, intermediate_size=192)
    reference = LlamaForCausalLM(config, rngs=nnx.Rngs(0), implementation="xla")
    mesh = parallel.tensor_parallel_mesh(2)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0), implementation="xla", mesh=mesh)

    init_programs = glob.glob(os.path.join(os.environ[INIT_DUMP_VARIABLE], f"*{INIT_PROGRAM}*after_optimizations.txt"))
    assert init_programs
    device_shapes = set()
    for program in init_programs:
        with open(program) as f:
            device_shapes |= {tuple(map(int, filter(None, dims.split(","))))
                              for dims in re.findall(r"\b(?:pred|[subf]\d+|bf16)\[([\d,]*)\]", f.read())}
    sharded = 0
    for (path, want), (_, got) in zip(nnx.to_flat_state(nnx.state(reference)), nnx.to_flat_state(nnx.state(model))):
        value = got.get_value()
        sharding = parallel.param_sharding(path, value.shape, mesh)
        np.testing.assert_array_equal(np.asarray(value), np.asarray(want.get_value()), err_msg=str(path))
        assert value.sharding.is_equivalent_to(sharding, value.ndim), path
        assert all(s.data.shape == sharding.shard_shape(value.shape) for s in value.addressable_shards), path
        if sharding.spec != P():
            sharded += 1
            flat = (value.shape[0], int(np.prod(value.shape[1:])))
            assert not {value.shape, flat} & device_shapes, (path, value.shape)
            assert sharding.shard_shape(value.shape) in device_shapes, path  # the check reads real shapes
    assert sharded == 4 * config.num_hidden_layers + 1, sharded  # qkv, o, gate_up, down per layer; lm_head

    # Four long prompts outgrow the 24-block cache within 40 tokens (one preemption); the
    # fifth waits for a free row, so prompts prefill beside decodes (mixed steps).
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    prompts = random_prompts(0, [70, 60, 45, 50, 12])
    want = dense_greedy_generate(reference, prompts, 40)
    base = engine_base()
    # Swapping moves sharded blocks to the host and back (recomputing is prefill again).
    engine = LLMEngine(model, dataclasses.replace(base, num_host_blocks=32))
    runner, first_calls = engine.runner, {}

    def recording(name, program):
        def call(*args, **static):
            first_calls.setdefault(name, (args, static))
            return program(*args, **static)
        return call

    runner._window, runner._mixed = recording("window", runner._window), recording("mixed", runner._mixed)
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, greedy, use_tqdm=False)] == want
    assert engine.stats.num_preemptions > 0 and engine.stats.num_swapped_out_blocks > 0, engine.stats
    cache = engine.runner.kv_caches[0]
    assert cache.sharding.is_equivalent_to(parallel.kv_cache_sharding(model.mesh), cache.ndim)

    all_reduces = 2 * config.num_hidden_layers
    for name, argmaxes in (("window", 1), ("mixed", 2)):
        args, static = first_calls[name]
        program = getattr(runner, f"{name}_program")
        for is_greedy in (True, False):
            hlo = program.lower(*args, **dict(static, greedy=is_greedy)).compile().as_text()
            found, gathers = count_collectives(hlo), gathered_shapes(hlo)
            if is_greedy:
                assert found == {"all-reduce": all_reduces, "all-gather": 2 * argmaxes}, (name, found)
                assert all(re.fullmatch(r"[fs]32\[\d+,2\]", shape) for shape in gathers), (name, gathers)
            else:
                assert found == {"all-reduce": all_reduces, "all-gather": 1}, (name, found)
                assert re.fullmatch(rf"f32\[\d+,{config.vocab_size}\]", gathers[0]), (name, gathers)

    (shared,) = random_prompts(2, [32])
    prompts = [shared, shared + [5, 6, 7], shared[:20] + [1, 2], shared]
    engine = LLMEngine(model, base)
    short = dataclasses.replace(greedy, max_tokens=8)  # sharing is decided at the prompt
    engine.generate([shared], short, use_tqdm=False)
    outs = engine.generate(prompts, short, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == dense_greedy_generate(reference, prompts, 8)
    assert engine.stats.num_copied_blocks >= 1 and outs[1].num_cached_tokens == 32

    # A one-device program on a host of several, stored and loaded back, runs on its device.
    from jax_paged_attn.engine.program_store import ProgramStore, call_signature

    with tempfile.TemporaryDirectory() as directory:
        add_one, x = jax.jit(lambda x: x + 1), jax.device_put(np.zeros(3, np.float32), jax.devices()[1])
        signature = call_signature((x,), {})
        ProgramStore(directory, ["key"]).load_or_compile("add_one", add_one, (x,), {}, signature)
        store = ProgramStore(directory, ["key"])
        np.testing.assert_array_equal(store.load_or_compile("add_one", add_one, (x,), {}, signature)(x), 1.0)
        assert store.num_loaded == 1
    print("checked the engine at tp=2")


if __name__ == "__main__":
    # As in conftest.py (which this process does not import first): a test process neither
    # writes the user's compilation cache nor loads programs an earlier run left there.
    jax.config.update("jax_enable_compilation_cache", False)
    {"equivalence": _equivalence_main, "replication": _replication_main, "engine": _engine_main}[sys.argv[1]]()
