"""What the engine decides before it serves, and the start report that says so.

* Compilation cache: `use_compilation_cache` points JAX's persistent compilation cache
  at the engine's directory (unless the process chose one, or the directory is not
  safe), and `program_store_dir` puts the engine's program store
  (`jax_paged_attn.engine.program_store`) beside it, so a second start loads its
  programs instead of compiling them (`LLMEngine.warmup`).
* Memory: unless ``num_blocks`` is given, the KV cache takes what the device has left
  beside the weights and the largest step's activations, up to
  ``gpu_memory_utilization`` of its memory (vLLM's rule; the activations from XLA's
  buffer assignment of the largest step, not from a profiling run's peak, so that every
  start picks the same count and the same program shapes): `kv_cache_blocks_for_memory`;
  the engine says what it chose. The caches are donated to every program, so writes
  are in place.
* The start report's lines: each of the above, the KV cache (`kv_cache_report`), and
  which code the model's attention and projections run (`implementation_report`,
  `matmul_report`). `LLMEngine.start_report` joins them, and logs them.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from jax_paged_attn.builder import ScheduledSequence
from jax_paged_attn.engine import trusted_directory
from jax_paged_attn.engine.config import DEFAULT_NUM_BLOCKS_WITHOUT_MEMORY_STATS, EngineConfig

Array = jax.Array


def program_store_dir(config: EngineConfig) -> str | None:
    """Where the engine keeps its compiled programs (`program_store`): beside JAX's
    persistent compilation cache, in its directory, and off when that cache is off
    (`use_compilation_cache` leaves it off in an untrusted directory). The runner checks
    the directory itself again (`trusted_directory.make_private_directory`)."""
    if not config.compilation_cache or not jax.config.jax_enable_compilation_cache:
        return None
    directory = jax.config.jax_compilation_cache_dir
    if not directory or trusted_directory.untrusted_directory_reason(directory):
        return None
    return os.path.join(directory, "jax_paged_attn_programs")


_CACHE_DIR_SET_BY_ENGINE: list[str] = []
"""The directory an engine pointed JAX's process-wide persistent cache at, if any."""


def use_compilation_cache(config: EngineConfig) -> str:
    """Points JAX's persistent compilation cache at ``config``'s directory unless the
    process chose one; returns the line saying what holds.

    The cache and the program store load native code from the directory, so a directory
    others can write (`trusted_directory.untrusted_directory_reason`) is not used: the
    engine runs without both and says so. JAX's cache is one per process: an engine
    whose ``compilation_cache_dir`` differs from the directory in use raises."""
    current = jax.config.jax_compilation_cache_dir
    if not config.compilation_cache:
        return f"compilation cache: off (EngineConfig.compilation_cache=False){'' if not current else f'; JAX caches in {current}'}"
    if not jax.config.jax_enable_compilation_cache:
        return "compilation cache: off (the process set jax_enable_compilation_cache=False)"
    requested = None if config.compilation_cache_dir is None else os.path.expanduser(config.compilation_cache_dir)
    if current and requested and os.path.realpath(requested) != os.path.realpath(current):
        raise ValueError(
            f"EngineConfig.compilation_cache_dir={config.compilation_cache_dir!r}, but JAX's persistent compilation "
            f"cache (one per process) already uses {current!r}; pass that directory or None.")
    if current:
        reason = trusted_directory.untrusted_directory_reason(current)
        owner = "an engine" if current in _CACHE_DIR_SET_BY_ENGINE else "the process"
        if reason:
            return (f"compilation cache: {current} (set by {owner}); program store off: the directory is not safe "
                    f"({reason})")
        return f"compilation cache: {current} (set by {owner})"
    directory = requested
    if directory is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        directory = os.path.join(base, "jax_paged_attn", "xla")
    reason = trusted_directory.make_private_directory(directory)
    if reason:
        # JAX's cache would load executables from there as the store would: both off.
        return (f"compilation cache: off, program store off ({reason}; a directory others can write would choose "
                f"the code this process runs: make it yours with mode 700, or set "
                f"EngineConfig.compilation_cache_dir)")
    jax.config.update("jax_compilation_cache_dir", directory)
    _CACHE_DIR_SET_BY_ENGINE.append(directory)
    # Every program, not only those over JAX's default second of compile time: a warm
    # start should trace and load, never compile.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return (f"compilation cache: {directory} (JAX's persistent cache, every program kept; "
            f"EngineConfig.compilation_cache_dir moves it)")



def implementation_report(model: Any) -> str:
    """Which code the model's attention runs, in words (`jax_paged_attn.dispatch`)."""
    from jax_paged_attn import dispatch

    layers = getattr(getattr(model, "model", None), "layers", None)
    attn = getattr(getattr(layers[0], "self_attn", None), "attn", None) if layers else None
    from jax_paged_attn import tuning

    impl = dispatch.normalize_implementation(getattr(attn, "implementation", None))
    backend = jax.default_backend()
    if impl == dispatch.AUTO:
        if backend == "gpu":
            head_size = getattr(getattr(model, "config", None), "head_dim", None)
            prefill = ""
            if head_size is not None and tuning.auto_prefers_mosaic_prefill(head_size):
                prefill = (f", prefill of long query runs (at least {dispatch.MOSAIC_AUTO_MIN_QUERY_ROWS_PER_SEQUENCE} "
                           f"rows per sequence) through the Mosaic GPU kernel (measured faster than the Triton one "
                           f"at head size {head_size} on this GPU)")
            return ("auto: Pallas Triton kernels for attention and the cache write on CUDA"
                    f"{prefill} (the pure-JAX reference for calls no kernel supports); {tuning.describe_tables()}")
        return f"auto: the pure-JAX reference (no Pallas kernel for the {backend} backend)"
    if impl == dispatch.MOSAIC_GPU:
        return ("mosaic_gpu (chosen by the model's implementation argument): the Mosaic GPU prefill and decode "
                "kernels with their default configs (not tuned yet), the Triton cache-write kernel")
    if impl == dispatch.TRITON and backend == "gpu":
        return f"{impl} (chosen by the model's implementation argument); {tuning.describe_tables()}"
    return f"{impl} (chosen by the model's implementation argument)"


def matmul_report(model: Any) -> str:
    """Which code the model's projections run, in words (`jax_paged_attn.matmul.linear`)."""
    from jax_paged_attn import matmul

    impl = getattr(model, "matmul_implementation", None)
    if impl in (None, "auto"):
        return f"auto: {matmul.auto_choice()}"
    return f"{impl} (chosen by the model's matmul_implementation argument)"


def model_report(model: Any) -> str:
    """The model's family and the path its decode step takes, in words (the model's
    ``family_report()``, `jax_paged_attn.models.LlamaForCausalLM.family_report`), or its
    class name for a model without one."""
    describe = getattr(model, "family_report", None)
    return describe() if callable(describe) else type(model).__name__


KV_CACHE_BLOCK_QUANTUM = 256
"""A KV cache sized from memory holds a multiple of this many blocks (when that many fit):
the count is in the shape of every program that takes the cache, so it must not move
with a process's allocation history, or a second start would miss every such program in
the persistent compilation cache."""


def device_memory_stats(device: Any) -> dict[str, int] | None:
    """The device's allocator statistics (``bytes_limit``, ``bytes_in_use``, ...), or None
    where the backend reports none (CPU)."""
    return device.memory_stats() if hasattr(device, "memory_stats") else None


def kv_cache_blocks_for_memory(model: Any, config: EngineConfig, max_model_len: int,
                               store_dir: str | None = None) -> tuple[int, str]:
    """KV cache blocks that fit beside what the device holds now (the weights) and the
    largest step's activations in ``gpu_memory_utilization`` of the device's memory,
    rounded down to a multiple of `KV_CACHE_BLOCK_QUANTUM`; and the line saying so.

    Every term is a function of the model, the configuration and the arrays alive now:
    the activations are XLA's buffer assignment for the largest step's program, not the
    allocator's peak, which also counts whatever the process compiled or freed before
    (XLA's autotuner allocates while it compiles, so a cold start's peak is higher than
    a warm start's). With ``store_dir`` (the program store's directory) the activations'
    figure is kept there and read back at later starts: a warm start then traces no model
    to size its cache (`largest_step_activation_bytes`)."""
    device = jax.devices()[0]
    stats = device_memory_stats(device)
    if not stats or "bytes_limit" not in stats:
        n = DEFAULT_NUM_BLOCKS_WITHOUT_MEMORY_STATS
        return n, (f"KV cache sized to {n} blocks: the {device.platform} device reports no memory statistics "
                   f"(pass EngineConfig.num_blocks to choose)")
    in_use = int(stats.get("bytes_in_use", 0))
    activations = (stored_activation_bytes(model, config, max_model_len, store_dir)
                   + penalty_state_bytes(model, config))
    one = model.allocate_kv_caches(1, config.block_size)
    bytes_per_block = sum(int(c.nbytes) for c in one)
    del one
    allowed = int(stats["bytes_limit"] * config.gpu_memory_utilization)
    n = (allowed - in_use - activations) // bytes_per_block
    if n < 1:
        raise ValueError(
            f"no room for a KV cache: the weights (and other arrays alive) take {in_use / (1 << 30):.2f} GiB and the "
            f"largest step's activations {activations / (1 << 30):.2f} GiB of the "
            f"{config.gpu_memory_utilization:.0%} ({allowed / (1 << 30):.2f} GiB) allowed by gpu_memory_utilization; "
            f"raise it or lower max_num_batched_tokens.")
    if n >= KV_CACHE_BLOCK_QUANTUM:
        n -= n % KV_CACHE_BLOCK_QUANTUM
    return n, (f"KV cache sized by gpu_memory_utilization={config.gpu_memory_utilization}: arrays alive "
               f"(weights) {in_use / (1 << 30):.2f} GiB + the largest step's activations and the "
               f"penalties' token counts {activations / (1 << 30):.2f} GiB (XLA's buffer assignment; "
               f"max_num_seqs x vocabulary), {n} blocks fit (a multiple of "
               f"{KV_CACHE_BLOCK_QUANTUM}: the same count, and the same programs, at every start)")


def penalty_state_bytes(model: Any, config: EngineConfig) -> int:
    """Device bytes the persistent batch's token counts take while a request uses penalties
    (`jax_paged_attn.engine.penalties`: ``output_counts`` i32 and ``prompt_mask`` bool of
    ``[max_num_seqs, vocab]``), reserved at start so that a penalized batch cannot run the
    device out of the memory the KV cache was sized in (164 MB at 256 rows of a
    128,256-token vocabulary)."""
    return config.max_num_seqs * int(model.config.vocab_size) * (4 + 1)


def stored_activation_bytes(model: Any, config: EngineConfig, max_model_len: int, store_dir: str | None) -> int:
    """`largest_step_activation_bytes`, kept in the program store at ``store_dir`` under the
    programs' key (the environment, the package and model sources, the parameters' shapes,
    the XLA options) and the sizes it depends on, and read from there when a start has
    measured it before; measured each time without a store (or a model it cannot key)."""
    from flax import nnx

    from jax_paged_attn.engine import program_store

    store = None
    if store_dir is not None:
        graphdef, state = nnx.split(model)
        options = tuple(sorted((config.compiler_options or {}).items()))
        key, reason = program_store.model_key(graphdef, model, tuple(jax.tree_util.tree_leaves(state)), options)
        if not reason and not trusted_directory.make_private_directory(store_dir):
            store = program_store.ProgramStore(store_dir, key)
    sizes = [f"max_num_batched_tokens {config.max_num_batched_tokens}", f"max_num_seqs {config.max_num_seqs}",
             f"max_model_len {max_model_len}", f"block_size {config.block_size}"]
    value = None if store is None else store.read_figure("activation_bytes", sizes)
    if value is None:
        value = largest_step_activation_bytes(model, config, max_model_len)
        if store is not None:
            store.write_figure("activation_bytes", sizes, value)
    return value


def largest_step_activation_bytes(model: Any, config: EngineConfig, max_model_len: int) -> int:
    """Device bytes a forward over ``max_num_batched_tokens`` prompt tokens with no cache
    (vLLM's profiling run) needs beside the weights: its other inputs, its outputs and
    its temporaries, as XLA's buffer assignment of the compiled program states them."""
    from flax import nnx

    from jax_paged_attn.builder import FlashAttentionMetadataBuilder as Builder

    num_tokens = config.max_num_batched_tokens
    seqs = max(1, min(config.max_num_seqs, num_tokens))
    lens = [num_tokens // seqs + (1 if i < num_tokens % seqs else 0) for i in range(seqs)]
    lens = [min(n, max_model_len) for n in lens if n > 0]
    builder = Builder(block_size=config.block_size, num_blocks=1, pad=False)
    metadata = builder.build([ScheduledSequence(is_prompt=True, seq_len=n, context_len=0, query_len=n,
                                                block_table=None) for n in lens])
    total = metadata.num_tokens
    graphdef, state = nnx.split(model)
    empty = [jax.numpy.zeros((0,), model.dtype) for _ in range(model.config.num_hidden_layers)]

    def forward(state: Any, ids: Array, positions: Array, md: Any) -> Array:
        rows = jax.numpy.maximum(md.query_start_loc[1:] - 1, 0)
        logits, _ = nnx.merge(graphdef, state)(ids, positions, empty, md, logits_indices=rows)
        return logits

    ids = np.zeros(total, np.int32)
    positions = np.concatenate([np.arange(n, dtype=np.int32) for n in lens])
    compiled = jax.jit(forward).trace(state, ids, positions, metadata).lower().compile()
    memory = compiled.memory_analysis()
    if memory is None:
        raise RuntimeError(f"the {jax.default_backend()} backend states no memory figures for a compiled program, so "
                           f"the KV cache cannot be sized from memory: pass EngineConfig.num_blocks.")
    inputs = sum(int(np.asarray(x).nbytes) for x in jax.tree_util.tree_leaves((ids, positions, metadata)))
    return int(memory.temp_size_in_bytes) + int(memory.output_size_in_bytes) + inputs



def kv_cache_report(num_blocks: int, block_size: int, bytes_per_block: int, num_host_blocks: int) -> str:
    """The start report's line on the KV cache the engine allocated."""
    total_gib = bytes_per_block * num_blocks / (1 << 30)
    return (f"KV cache: {num_blocks} blocks of {block_size} tokens "
            f"({num_blocks * block_size:,} tokens, {total_gib:.2f} GiB); host swap space "
            f"{num_host_blocks} blocks")
