"""The engine's device side: parameters, KV caches, the persistent decode batch and the
jitted programs that run on them.

The scheduler (`jax_paged_attn.engine.scheduler`) decides on the host what runs; this
module owns everything that lives on the device between steps and never reads a device
value back by itself. Three programs:

* **step** (`ModelRunner.run_step`): one forward + sampling over any batch the metadata
  builder describes (prefill chunks, decodes, both). Used for admission, chunked
  prefill, recomputation and every step the scheduler must see token by token.
* **decode window** (`ModelRunner.run_decode_window`): ``num_steps`` decode steps in one
  ``lax.fori_loop`` over the *persistent batch* (`DecodeState`): each running request
  keeps a row whose last token, position, block-table row, sampling parameters, RNG
  counter and stop conditions stay on the device. Each step builds its decode metadata
  on the device, runs the forward, samples, checks the stop conditions (stop ids, EOS,
  ``max_tokens``, ``max_model_len``) and moves the row on; a row that stopped writes
  nothing more to the cache (`PAD_SLOT_ID`) and samples nothing. The host sends only
  what changed: the blocks appended to rows since the last window and the rows it
  aborted.
* **mixed step** (`ModelRunner.run_mixed`): prompt chunks and one decode step of the
  persistent batch in one forward; the prompts that end in it take free rows of the
  batch with the token just sampled (its stop check on the device), so the next
  program decodes them without a host round trip.

No program holds a data-dependent branch (XLA would copy the predicate to the host
and make the call wait for the whole step): the sampler is chosen statically (greedy or
not), and stopped rows are masked. Log probabilities likewise: a static ``num_logprobs``
(None: none, the programs are unchanged) compiles a variant that also returns the
sampled tokens' logprobs and the top ``num_logprobs`` of every row (`TokenLogprobs`). The
penalties, ``logit_bias``, ``min_tokens`` and ``min_p`` too: a program given a
`Penalties` tree (the decode state's, with its token counts; a step's prompts send
their token ids, `StepPenalties`, which the program counts) applies them, one given
None is the program without them (`jax_paged_attn.engine.penalties`). The parameters
are passed as one flat tuple of arrays (flattening an NNX state costs far more host
time per call), and the caches are donated, so every cache write is in place.

The model contract is `CausalLM`.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_paged_attn.engine import program_store as store_lib
from jax_paged_attn.engine.trusted_directory import make_private_directory
from jax_paged_attn.engine.penalties import (
    Penalties,
    PenaltyTokens,
    StepPenalties,
    apply_penalties,
    count_tokens,
    with_token_counts,
)
from jax_paged_attn.engine.sampling import TokenLogprobs, greedy_tokens, sample_tokens, token_logprobs
from jax_paged_attn.metadata import FlashAttentionMetadata, concatenate_sections
from jax_paged_attn.builder import pad_to_bucket
from jax_paged_attn.spec import PAD_SLOT_ID

Array = jax.Array

NO_TOKEN = -1
"""Token id of a decode-window step in which a row sampled nothing (it had stopped)."""

NO_STOP_ID = -1
"""Padding of `DecodeState.stop_ids` (no token has this id)."""

MIN_DECODE_ROWS = 2
"""Fewest rows of a persistent batch. With one row every projection is a vector-matrix
product, which XLA's GPU simplifier rewrites into an elementwise multiply that writes
the whole weight-sized product and a reduction that reads it back (3x the weight
traffic: 1.37 ms per step instead of about 0.9 for a 1.1B model on an H200); a second,
inactive row keeps them matrix products at the cost of one masked row."""


def decode_batch_rows(num_requests: int, buckets: Sequence[int] | None = None) -> int:
    """Rows of a persistent batch holding ``num_requests``: the smallest of ``buckets``
    that holds them (None: the next power of two; few sizes, few compiled programs), at
    least `MIN_DECODE_ROWS`."""
    return pad_to_bucket(max(MIN_DECODE_ROWS, num_requests), buckets)


@runtime_checkable
class ModelConfig(Protocol):
    """What the engine reads of a model's configuration.

    Read when present (`jax_paged_attn.models.LlamaConfig` has them): ``kv_cache_window``
    (the window outside which blocks may be freed: ``sliding_window`` when every layer
    has it, else None; default ``sliding_window``), ``max_sequence_length`` (default
    ``max_position_embeddings``) and ``rope_depends_on_length`` (True turns prefix
    caching off; default False)."""

    vocab_size: int
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    sliding_window: int | None


@runtime_checkable
class CausalLM(Protocol):
    """The model contract of `jax_paged_attn.engine.LLMEngine` (an NNX module).

    `jax_paged_attn.models.LlamaForCausalLM` implements it.
    """

    config: ModelConfig
    dtype: Any  # compute dtype
    kv_cache_dtype: str  # "auto", "fp8", "fp8_e4m3" or "fp8_e5m2"

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[Array]:
        """One zeroed cache ``[2, num_blocks, block_size, Hk, D]`` per layer."""
        ...

    def __call__(self, input_ids: Array, positions: Array, kv_caches: Sequence[Array], metadata: Any, *,
                 logits_indices: Array | None = None) -> tuple[Array, list[Array]]:
        """Packed tokens ``[T]`` -> (float32 logits ``[N, vocab]``, updated caches)."""
        ...


def check_model(model: Any) -> None:
    """Raises TypeError naming what ``model`` lacks of the `CausalLM` contract."""
    missing = [name for name in ("config", "dtype", "kv_cache_dtype", "allocate_kv_caches")
               if not hasattr(model, name)]
    if not callable(model):
        missing.append("__call__")
    if missing:
        raise TypeError(f"model must implement the CausalLM contract; it lacks {missing}.")
    config = model.config
    lacking = [name for name in ModelConfig.__annotations__ if not hasattr(config, name)]
    if lacking:
        raise TypeError(f"model.config must have the ModelConfig fields; it lacks {lacking}.")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """The persistent decode batch on the device: one row per running request.

    Padding rows (and rows whose request stopped) have ``active`` False.

    Attributes:
      tokens: i32[R]: each row's last token, the next step's input.
      positions: i32[R]: that token's position (tokens in the sequence - 1).
      active: bool[R]: the row decodes (it has not stopped).
      block_tables: i32[R, W]: the row's cache blocks (entries past its end are unused).
      temperature, top_p: f32[R]; top_k: i32[R]; seed: u32[R]: sampling parameters.
      num_generated: i32[R]: output tokens so far (the RNG counter of the next token).
      max_tokens: i32[R]: the request's ``max_tokens``.
      stop_ids: i32[R, S]: token ids that stop the row (EOS included unless ignored),
        padded with `NO_STOP_ID`.
      penalties: the rows' `Penalties` (with their output-token counts, which the
        programs keep up to date), or None: a batch in which no request uses penalties,
        ``logit_bias``, ``min_tokens`` or ``min_p`` runs the programs without them.
    """

    tokens: Array
    positions: Array
    active: Array
    block_tables: Array
    temperature: Array
    top_p: Array
    top_k: Array
    seed: Array
    num_generated: Array
    max_tokens: Array
    stop_ids: Array
    penalties: Penalties | None = None

    @staticmethod
    def empty(num_rows: int, width: int, num_stop_ids: int, vocab_size: int | None = None) -> "DecodeState":
        """Inactive rows with NumPy leaves, for the host to fill and `ModelRunner.start_decode`
        to upload; with ``vocab_size``, rows of a batch that applies `Penalties` (neutral)."""
        penalties = None if vocab_size is None else Penalties.neutral(num_rows, vocab_size, num_stop_ids)
        return DecodeState(
            tokens=np.zeros(num_rows, np.int32), positions=np.zeros(num_rows, np.int32),
            active=np.zeros(num_rows, bool), block_tables=np.zeros((num_rows, width), np.int32),
            temperature=np.zeros(num_rows, np.float32), top_p=np.ones(num_rows, np.float32),
            top_k=np.full(num_rows, -1, np.int32), seed=np.zeros(num_rows, np.uint32),
            num_generated=np.zeros(num_rows, np.int32), max_tokens=np.ones(num_rows, np.int32),
            stop_ids=np.full((num_rows, num_stop_ids), NO_STOP_ID, np.int32), penalties=penalties)


def decode_metadata(positions: Array, active: Array, block_tables: Array, block_size: int) -> FlashAttentionMetadata:
    """Decode-only metadata of one step of the persistent batch (jnp; traced).

    Row ``r`` feeds its token at ``positions[r]``: it reads ``positions[r] + 1`` keys and
    writes its K/V to that position's slot. Inactive rows read no key (``seq_len`` 0,
    their output is 0) and write nothing (`PAD_SLOT_ID`).
    """
    num_rows, width = block_tables.shape
    block_index = jnp.minimum(positions // block_size, width - 1)
    block = jnp.take_along_axis(block_tables, block_index[:, None], axis=1)[:, 0]
    in_table = positions < width * block_size
    slot = jnp.where(active & in_table, block * block_size + positions % block_size, PAD_SLOT_ID)
    seq_lens = jnp.where(active, positions + 1, 0).astype(jnp.int32)
    return FlashAttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decode_tokens=num_rows, max_query_len=1,
        max_decode_query_len=1, max_prefill_seq_len=0, max_decode_seq_len=width * block_size,
        slot_mapping=slot.astype(jnp.int32),
        seq_lens=seq_lens,
        query_start_loc=jnp.arange(num_rows + 1, dtype=jnp.int32),
        seq_start_loc=jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(seq_lens, dtype=jnp.int32)]),
        context_lens=jnp.maximum(seq_lens - 1, 0),
        block_tables=block_tables,
        block_size=block_size,
    )


def stopped(tokens: Any, num_generated: Any, positions: Any, stop_ids: Any, max_tokens: Any,
            max_model_len: int) -> Any:
    """bool[R]: the row's new token ends it (the scheduler's rule, vectorized; jnp or NumPy).

    ``tokens`` were just sampled after the token at ``positions``; ``num_generated``
    counts them already. A stop id (or EOS), ``max_tokens`` outputs, or a context of
    ``max_model_len`` tokens (``positions + 2``) ends a row.
    """
    xp = np if isinstance(tokens, np.ndarray) else jnp
    hit_stop = xp.any(tokens[:, None] == stop_ids, axis=1)
    return hit_stop | (num_generated >= max_tokens) | (positions + 2 >= max_model_len)


def whole_vocabulary(model: Any, logits: Array) -> Array:
    """``logits`` ``[N, vocab]`` replicated on the model's mesh (unchanged without one;
    traced). Sampling sorts and sums over the whole vocabulary: on the vocabulary-
    parallel logits of a tensor-parallel LM head, XLA partitions those with several
    all-gathers and all-to-alls of the logits per step; gathered once here, sampling
    runs whole on every device. Greedy programs keep the sharded logits: their argmax
    gathers only each device's (max, index) per row."""
    mesh = getattr(model, "mesh", None)
    if mesh is None:
        return logits
    return jax.lax.with_sharding_constraint(logits, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def sample_batch(logits: Array, sampling: tuple[Array, ...], penalties: Penalties | None, *, greedy: bool) -> Array:
    """Tokens i32[B] of a step's sequences from their ``logits`` [B, V] and sampling
    arrays ``(temperature, top_p, top_k, seed, counter)``, after their ``penalties``
    (None: none applied; ``counter`` counts the tokens each generated so far)."""
    min_p = None
    if penalties is not None:
        logits, min_p = apply_penalties(logits, penalties, sampling[4]), penalties.min_p
    return greedy_tokens(logits) if greedy else sample_tokens(logits, *sampling, min_p=min_p)


def counted_penalties(penalties: StepPenalties | None, vocab_size: int) -> Penalties | None:
    """A step's `Penalties` with their counts, from the rows' token ids (traced)."""
    return None if penalties is None else with_token_counts(*penalties, vocab_size)


DONATE_ARGNUMS = dict(insert=(0,), step=(1,), window=(1, 2), mixed=(1, 2))
"""Each program's donated arguments (the decode state, the KV caches): the program
store's loaded programs, which are never traced, take them from here."""


class _Programs:
    """The jitted programs of one model structure (shared by engines, so by their
    compiled programs), and how often each was traced (= compiled)."""

    def __init__(self, graphdef: Any, treedef: Any, compiler_options: tuple[tuple[str, Any], ...]) -> None:
        self.num_traces = 0
        self._lock = threading.Lock()
        options = dict(compiler_options) or None

        def model_of(params: tuple[Array, ...]) -> Any:
            return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, list(params)))

        def step(params: tuple[Array, ...], kv_caches: list[Array], input_ids: Array, positions: Array,
                 metadata: FlashAttentionMetadata, sampling: tuple[Array, ...], penalties: StepPenalties | None, *,
                 greedy: bool, num_logprobs: int | None = None) -> tuple[Array, list[Array], TokenLogprobs | None]:
            self._count_trace()
            # Last token row of every sequence (padding sequences own >= 1 row or point
            # at a real row; their tokens are ignored).
            last_rows = jnp.maximum(metadata.query_start_loc[1:] - 1, 0).astype(jnp.int32)
            model = model_of(params)
            logits, new_caches = model(input_ids, positions, kv_caches, metadata, logits_indices=last_rows)
            logits = logits if greedy else whole_vocabulary(model, logits)
            tokens = sample_batch(logits, sampling, counted_penalties(penalties, logits.shape[-1]), greedy=greedy)
            logprobs = None if num_logprobs is None else token_logprobs(logits, tokens, num_logprobs)
            return tokens, list(new_caches), logprobs

        def advance_rows(s: DecodeState, logits: Array, *, greedy: bool, max_model_len: int,
                         num_logprobs: int | None) -> tuple[DecodeState, Array, TokenLogprobs | None]:
            """Samples each active row's next token from its ``logits`` and moves the row
            on (stop checks included); returns the new state, the tokens i32[R]
            (`NO_TOKEN` for inactive rows) and their logprobs (junk for inactive rows)."""
            sampled = sample_batch(logits, (s.temperature, s.top_p, s.top_k, s.seed, s.num_generated), s.penalties,
                                   greedy=greedy)
            num_generated = s.num_generated + s.active.astype(jnp.int32)
            done = stopped(sampled, num_generated, s.positions, s.stop_ids, s.max_tokens, max_model_len)
            logprobs = None if num_logprobs is None else token_logprobs(logits, sampled, num_logprobs)
            out = jnp.where(s.active, sampled, NO_TOKEN)
            s = dataclasses.replace(
                s, tokens=jnp.where(s.active, sampled, s.tokens),
                positions=jnp.where(s.active, s.positions + 1, s.positions),
                num_generated=num_generated, active=s.active & ~done,
                penalties=None if s.penalties is None else count_tokens(s.penalties, sampled, s.active))
            return s, out, logprobs

        def insert(state: DecodeState, row_index: Array, rows: DecodeState) -> DecodeState:
            # Row ``row_index[j]`` takes ``rows``' row j; an index of R (padding) is dropped.
            return jax.tree_util.tree_map(lambda old, new: old.at[row_index].set(new, mode="drop"), state, rows)

        def updated(state: DecodeState, keep: Array, block_rows: Array, block_values: Array) -> DecodeState:
            return dataclasses.replace(
                state, active=state.active & keep,
                block_tables=state.block_tables.at[block_rows].set(block_values, mode="drop"))

        def window(params: tuple[Array, ...], kv_caches: list[Array], state: DecodeState, keep: Array,
                   block_rows: Array, block_values: Array, *, num_steps: int, greedy: bool, block_size: int,
                   max_model_len: int, num_logprobs: int | None = None
                   ) -> tuple[Array, TokenLogprobs | None, DecodeState, list[Array]]:
            self._count_trace()
            model = model_of(params)
            num_rows = state.tokens.shape[0]
            state = updated(state, keep, block_rows, block_values)
            rows = jnp.arange(num_rows, dtype=jnp.int32)

            def body(k: Array, carry: tuple[DecodeState, list[Array], Array, TokenLogprobs | None]):
                s, caches, out, lp_out = carry
                metadata = decode_metadata(s.positions, s.active, s.block_tables, block_size)
                logits, caches = model(s.tokens, s.positions, caches, metadata, logits_indices=rows)
                logits = logits if greedy else whole_vocabulary(model, logits)
                s, sampled, step_lp = advance_rows(s, logits, greedy=greedy, max_model_len=max_model_len,
                                                   num_logprobs=num_logprobs)
                out = out.at[k].set(sampled)
                if lp_out is not None:  # rows that sampled nothing hold junk; the host skips them
                    lp_out = jax.tree_util.tree_map(lambda acc, x: acc.at[k].set(x), lp_out, step_lp)
                return s, list(caches), out, lp_out

            out = jnp.full((num_steps, num_rows), NO_TOKEN, jnp.int32)
            lp_out = None
            if num_logprobs is not None:
                shape = (num_steps, num_rows)
                lp_out = TokenLogprobs(
                    jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.int32),
                    jnp.zeros(shape + (num_logprobs,), jnp.float32), jnp.zeros(shape + (num_logprobs,), jnp.int32))
            state, kv_caches, out, lp_out = jax.lax.fori_loop(0, num_steps, body,
                                                              (state, list(kv_caches), out, lp_out))
            return out, lp_out, state, kv_caches

        def mixed(params: tuple[Array, ...], kv_caches: list[Array], state: DecodeState, keep: Array,
                  block_rows: Array, block_values: Array, input_ids: Array, positions: Array,
                  metadata: FlashAttentionMetadata, sampling: tuple[Array, ...], join_index: Array,
                  join_rows: DecodeState, prompt_penalties: StepPenalties | None, *, greedy: bool, block_size: int,
                  max_model_len: int, num_logprobs: int | None = None):
            # Prompt chunks (``metadata``: prefills only, the batch's block-table width)
            # and one decode step of every batch row, in one forward: the weights are
            # read once for both. Then the prompts that ended take their rows, with the
            # token just sampled, so the next program decodes them without the host.
            self._count_trace()
            state = updated(state, keep, block_rows, block_values)
            rows_md = decode_metadata(state.positions, state.active, state.block_tables, block_size)
            md = concatenate_sections(metadata, rows_md)
            num_prefill_rows, num_prefill_tokens = metadata.num_seqs, metadata.num_prefill_tokens
            num_rows = state.tokens.shape[0]
            last_rows = jnp.concatenate([
                jnp.maximum(metadata.query_start_loc[1:] - 1, 0).astype(jnp.int32),
                num_prefill_tokens + jnp.arange(num_rows, dtype=jnp.int32)])
            model = model_of(params)
            logits, new_caches = model(
                jnp.concatenate([input_ids, state.tokens]), jnp.concatenate([positions, state.positions]),
                kv_caches, md, logits_indices=last_rows)
            logits = logits if greedy else whole_vocabulary(model, logits)
            prefill_logits = logits[:num_prefill_rows]
            prompt_counted = counted_penalties(prompt_penalties, logits.shape[-1])
            tokens = sample_batch(prefill_logits, sampling, prompt_counted, greedy=greedy)
            logprobs = None if num_logprobs is None else token_logprobs(prefill_logits, tokens, num_logprobs)
            state, out, rows_lp = advance_rows(state, logits[num_prefill_rows:], greedy=greedy,
                                               max_model_len=max_model_len, num_logprobs=num_logprobs)
            rows_lp = None if rows_lp is None else jax.tree_util.tree_map(lambda x: x[None], rows_lp)
            first_done = stopped(tokens, join_rows.num_generated, join_rows.positions - 1, join_rows.stop_ids,
                                 join_rows.max_tokens, max_model_len)
            joined = dataclasses.replace(join_rows, tokens=tokens, active=join_rows.active & ~first_done)
            if state.penalties is not None:
                # A joining row's penalties are its prompt's, counting the token just sampled.
                assert prompt_counted is not None, "a batch with penalties takes the prompts' penalties"
                counted = count_tokens(prompt_counted, tokens, join_index < num_rows)
                counted = dataclasses.replace(counted, stop_ids=join_rows.stop_ids)  # the batch's columns
                joined = dataclasses.replace(joined, penalties=counted)
            state = insert(state, join_index, joined)
            return tokens, logprobs, out[None], rows_lp, state, list(new_caches)

        self.insert = jax.jit(insert, donate_argnums=DONATE_ARGNUMS["insert"])
        self.step = jax.jit(step, donate_argnums=DONATE_ARGNUMS["step"], static_argnames=("greedy", "num_logprobs"), compiler_options=options)
        self.window = jax.jit(window, donate_argnums=DONATE_ARGNUMS["window"],
                              static_argnames=("num_steps", "greedy", "block_size", "max_model_len", "num_logprobs"),
                              compiler_options=options)
        self.mixed = jax.jit(mixed, donate_argnums=DONATE_ARGNUMS["mixed"],
                             static_argnames=("greedy", "block_size", "max_model_len", "num_logprobs"),
                             compiler_options=options)

    def _count_trace(self) -> None:  # runs only while tracing: one per compiled program
        with self._lock:
            self.num_traces += 1


# The programs' argument and result trees hold these: the store's files carry the trees.
store_lib.register_pytree_serialization(DecodeState, FlashAttentionMetadata, TokenLogprobs, Penalties, PenaltyTokens)


@functools.lru_cache(maxsize=16)
def _programs(graphdef: Any, treedef: Any, compiler_options: tuple[tuple[str, Any], ...]) -> _Programs:
    return _Programs(graphdef, treedef, compiler_options)


class ModelRunner:
    """Owns the model's parameters, the KV caches, the persistent decode batch and the
    jitted programs; every call dispatches device work and returns device arrays.

    Args:
      model: a `CausalLM`.
      num_blocks, block_size: the device KV cache (per layer).
      compiler_options: XLA options of the jitted programs (``jax.jit``'s).
      program_store_dir: a directory of compiled programs (`program_store.ProgramStore`): each
        program is loaded from it, or compiled and written to it, on its first call;
        None: the programs are plain ``jax.jit`` functions.
    """

    def __init__(self, model: CausalLM, *, num_blocks: int, block_size: int,
                 compiler_options: Mapping[str, Any] | None = None, program_store_dir: str | None = None,
                 manifest_lines: Sequence[str] = ()) -> None:
        check_model(model)
        graphdef, state = nnx.split(model)
        leaves, treedef = jax.tree_util.tree_flatten(state)
        self.params: tuple[Array, ...] = tuple(leaves)
        self.block_size = block_size
        self._allocate_kv_caches = functools.partial(model.allocate_kv_caches, num_blocks, block_size)
        self.kv_caches: list[Array] = list(self._allocate_kv_caches())
        options = tuple(sorted((compiler_options or {}).items()))
        self._programs = _programs(graphdef, treedef, options)
        self._decode_state: DecodeState | None = None
        programs = self._programs
        self._step, self._window, self._mixed, self._insert = programs.step, programs.window, programs.mixed, programs.insert
        self.program_store: store_lib.ProgramStore | None = None
        self.program_store_line = "program store: off"
        if program_store_dir is not None:
            key, reason = store_lib.model_key(graphdef, model, self.params, options)
            untrusted = None if reason else make_private_directory(program_store_dir)
            if reason:
                self.program_store_line = f"program store: off ({reason}: its programs cannot be keyed by source)"
            elif untrusted:
                self.program_store_line = (f"program store: off ({untrusted}: whoever can write there would choose "
                                           f"the programs this process runs)")
            else:
                device = jax.devices()[0]
                single = all(getattr(x, "sharding", None) is not None and x.sharding.device_set == {device}
                             for x in self.params)
                store = self.program_store = store_lib.ProgramStore(program_store_dir, key,
                                                                    device=device if single else None)
                self._step, self._window, self._mixed = (
                    store_lib.StoredProgram(getattr(programs, name), name, store, params_first=True,
                                            donate_argnums=DONATE_ARGNUMS[name], compiler_options=dict(options))
                    for name in ("step", "window", "mixed"))
                self._insert = store_lib.StoredProgram(programs.insert, "insert", store, params_first=False,
                                                       donate_argnums=DONATE_ARGNUMS["insert"])
                self.program_store_line = (f"program store: {program_store_dir} (compiled programs by source, "
                                           f"model, JAX and device; a second start loads them without tracing)")
                started = store.prefetch({**{name: dict(options) for name in ("step", "window", "mixed")},
                                          "insert": None}, manifest_lines)
                if started:
                    self.program_store_line += (
                        f"; {started} stored programs read and compiled side by side: " + (
                            "those this configuration's last warm-up used, in its order" if store.prefetched_from_manifest
                            else "every program of this model (no warm-up of this configuration recorded yet)"))

    @property
    def num_traces(self) -> int:
        """Programs traced (= compiled) so far by every runner of this model structure."""
        return self._programs.num_traces

    @property
    def step_program(self) -> Any:
        return self._programs.step

    @property
    def window_program(self) -> Any:
        return self._programs.window

    @property
    def mixed_program(self) -> Any:
        return self._programs.mixed

    def run_step(self, token_ids: np.ndarray, positions: np.ndarray, metadata: FlashAttentionMetadata,
                 sampling: tuple[np.ndarray, ...], penalties: StepPenalties | None = None, *, greedy: bool,
                 num_logprobs: int | None = None) -> Array | tuple[Array, TokenLogprobs]:
        """One forward + sampling over a builder-made batch; returns the tokens i32[B]
        (one per metadata sequence, on the device). The caches are updated in place.
        ``penalties``: host `StepPenalties` of the B sequences, or None (the program without them).

        With ``num_logprobs`` (static: each value is its own program) it returns
        ``(tokens, TokenLogprobs)``, leading dim ``[B]``.
        """
        tokens, self.kv_caches, logprobs = self._step(
            self.params, self.kv_caches, token_ids, positions, metadata, sampling, penalties, greedy=greedy,
            num_logprobs=num_logprobs)
        return tokens if logprobs is None else (tokens, logprobs)

    def rebuild_kv_caches_if_consumed(self) -> bool:
        """Allocates the KV caches anew when a program that failed had consumed (been
        donated) any of them; returns whether it did. Their contents are lost either way
        a failed step leaves them: the caller drops what pointed into them."""
        if not any(cache.is_deleted() for cache in self.kv_caches):
            return False
        for cache in self.kv_caches:
            if not cache.is_deleted():
                cache.delete()  # its memory is needed for the new caches
        self.kv_caches = list(self._allocate_kv_caches())
        return True

    def start_decode(self, rows: DecodeState) -> None:
        """Uploads a new persistent batch (host rows from `DecodeState.empty`, filled in)."""
        # device_put, not jnp.asarray: the latter compiles a staging program per shape.
        self._decode_state = jax.device_put(rows)

    def drop_decode_state(self) -> None:
        self._decode_state = None

    def insert_decode_rows(self, row_index: np.ndarray, rows: DecodeState) -> None:
        """Overwrites rows of the persistent batch on the device, after the windows
        already dispatched (programs run in order): row ``row_index[j]`` takes ``rows``'
        row j (host rows from `DecodeState.empty` with the batch's row count, width and
        stop-id columns; an index equal to the row count pads and is ignored)."""
        assert self._decode_state is not None, "start_decode first"
        self._decode_state = self._insert(self._decode_state, row_index, rows)

    def run_decode_window(self, keep: np.ndarray, block_rows: np.ndarray, block_values: np.ndarray, *,
                          num_steps: int, greedy: bool, max_model_len: int, num_logprobs: int | None = None
                          ) -> Array | tuple[Array, TokenLogprobs]:
        """Runs ``num_steps`` decode steps of the persistent batch.

        Args:
          keep: bool[R]: False stops a row before the window (an aborted request).
          block_rows: i32[U]: rows whose block-table row changed (``R`` = padding, ignored).
          block_values: i32[U, W]: their new block-table rows.

        Returns the sampled tokens i32[num_steps, R] (`NO_TOKEN` where a row sampled
        nothing), on the device; its copy to the host has been started. With
        ``num_logprobs``: ``(tokens, TokenLogprobs)``, leading dims ``[num_steps, R]``,
        copied to the host with the tokens.
        """
        assert self._decode_state is not None, "start_decode first"
        out, logprobs, self._decode_state, self.kv_caches = self._window(
            self.params, self.kv_caches, self._decode_state, keep, block_rows, block_values,
            num_steps=num_steps, greedy=greedy, block_size=self.block_size, max_model_len=max_model_len,
            num_logprobs=num_logprobs)
        out.copy_to_host_async()
        if logprobs is None:
            return out
        for leaf in jax.tree_util.tree_leaves(logprobs):
            leaf.copy_to_host_async()
        return out, logprobs

    def run_mixed(self, keep: np.ndarray, block_rows: np.ndarray, block_values: np.ndarray, token_ids: np.ndarray,
                  positions: np.ndarray, metadata: FlashAttentionMetadata, sampling: tuple[np.ndarray, ...],
                  join_index: np.ndarray, join_rows: DecodeState, prompt_penalties: StepPenalties | None = None, *,
                  greedy: bool, max_model_len: int, num_logprobs: int | None = None) -> tuple[Any, Any]:
        """One forward over prompt chunks and one decode step of the persistent batch,
        then the prompts that ended join the batch.

        Args:
          keep, block_rows, block_values: the batch's updates, as `run_decode_window`'s.
          token_ids, positions, metadata, sampling: a prefill-only batch from the metadata
            builder whose block table is as wide as the persistent batch's, as `run_step`'s.
          join_index: i32[P] (P = the metadata's sequences): the batch row that prompt
            sequence ``p`` takes after the step, or ``R`` (the row count: it joins no row).
          join_rows: a host `DecodeState` of P rows (the batch's width and stop-id
            columns) describing each joining sequence as it will be after its sampled
            token: ``positions`` that token's position, ``num_generated`` counting it;
            ``tokens`` is ignored (the step's sampled token is taken) and a row whose
            token already ends it is inactive. Its ``penalties`` are None: a batch with
            penalties gives each joining row its prompt's ``prompt_penalties``.
          prompt_penalties: host `StepPenalties` of the P prompt sequences; given exactly when
            the batch has penalties (None: the prompts sample without them).
          greedy: every prompt and every batch row samples greedily (static).
          num_logprobs: static logprobs width of the prompts' and the rows' tokens, or None.

        Returns ``(prompt_result, rows_result)``: the prompts' tokens i32[P] (one per
        metadata sequence) and the rows' tokens i32[1, R] (`NO_TOKEN` where a row sampled
        nothing), each ``(tokens, TokenLogprobs)`` with ``num_logprobs``; on the device,
        their copies to the host started (the rows' a window of one step for the reader).
        """
        assert self._decode_state is not None, "start_decode first"
        tokens, logprobs, out, rows_lp, self._decode_state, self.kv_caches = self._mixed(
            self.params, self.kv_caches, self._decode_state, keep, block_rows, block_values, token_ids, positions,
            metadata, sampling, join_index, join_rows, prompt_penalties, greedy=greedy, block_size=self.block_size,
            max_model_len=max_model_len,
            num_logprobs=num_logprobs)
        for leaf in jax.tree_util.tree_leaves((tokens, logprobs, out, rows_lp)):
            leaf.copy_to_host_async()
        return (tokens if logprobs is None else (tokens, logprobs)), (out if rows_lp is None else (out, rows_lp))
