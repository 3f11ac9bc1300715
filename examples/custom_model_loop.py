#!/usr/bin/env python3
"""Your own Flax NNX model on the paged KV cache, decoding in your own jitted loop.

No `LLMEngine` and no Llama: a small decoder of its own puts `jax_paged_attn.PagedAttention`
in its attention layers. Generation is two `jax.jit` programs:

1. prefill: the prompts, packed into one ``[T]`` token array that a
   `FlashAttentionMetadataBuilder` describes (built once, on the host), write their keys
   and values into the paged caches and give each prompt's first new token;
2. decode: a `jax.lax.fori_loop` whose body runs the model on one token per sequence,
   picks the greedy token and moves the metadata one token on with
   `jax_paged_attn.advance_step`, on the device: no host round trip per token.

Both programs donate the KV caches (``donate_argnums``), so each step writes its keys
and values into the same buffers. The greedy tokens are then checked against a dense
forward with no cache at all::

    python examples/custom_model_loop.py
    python examples/custom_model_loop.py --implementation triton --interpret   # Pallas kernels on a CPU
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
from typing import Any, Callable

# Run as a script from anywhere: make the working tree's jax_paged_attn importable.
_REPO = pathlib.Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jax_paged_attn as jpa  # noqa: E402
from jax_paged_attn.builder import input_positions, pack_per_token, sequence_rows  # noqa: E402

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    """A small pre-norm decoder with learned absolute positions and grouped-query attention."""

    vocab_size: int = 96
    max_len: int = 128
    hidden: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 32


class Block(nnx.Module):
    """LayerNorm -> attention over the paged cache -> LayerNorm -> GELU MLP, with residuals."""

    def __init__(self, cfg: TinyConfig, *, implementation: str | None, interpret: bool, rngs: nnx.Rngs):
        self.cfg = cfg
        d = cfg.head_size
        self.norm1 = nnx.LayerNorm(cfg.hidden, rngs=rngs)
        self.qkv = nnx.Linear(cfg.hidden, (cfg.num_heads + 2 * cfg.num_kv_heads) * d, rngs=rngs)
        self.proj = nnx.Linear(cfg.num_heads * d, cfg.hidden, rngs=rngs)
        # The library's layer: writes this layer's new keys / values into its cache and
        # attends over it, for prefill and decode tokens alike (metadata says which).
        self.attn = jpa.PagedAttention(num_heads=cfg.num_heads, head_size=d, num_kv_heads=cfg.num_kv_heads,
                                       implementation=implementation, interpret=interpret)
        self.norm2 = nnx.LayerNorm(cfg.hidden, rngs=rngs)
        self.up = nnx.Linear(cfg.hidden, 4 * cfg.hidden, rngs=rngs)
        self.down = nnx.Linear(4 * cfg.hidden, cfg.hidden, rngs=rngs)

    def _qkv(self, x: Array) -> tuple[Array, Array, Array]:
        """``[..., hidden]`` -> q ``[..., Hq * D]``, k and v ``[..., Hk * D]``."""
        q_size, kv_size = self.cfg.num_heads * self.cfg.head_size, self.cfg.num_kv_heads * self.cfg.head_size
        qkv = self.qkv(self.norm1(x))
        return qkv[..., :q_size], qkv[..., q_size:q_size + kv_size], qkv[..., q_size + kv_size:]

    def _mlp(self, x: Array) -> Array:
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))

    def __call__(self, x: Array, kv_cache: Array, metadata: jpa.FlashAttentionMetadata) -> tuple[Array, Array]:
        """Packed tokens ``x`` f32[T, hidden] -> (f32[T, hidden], the updated cache)."""
        q, k, v = self._qkv(x)
        attn, kv_cache = self.attn(q, k, v, kv_cache, metadata)
        return self._mlp(x + self.proj(attn)), kv_cache

    def dense(self, x: Array) -> Array:
        """``[B, S, hidden]`` -> ``[B, S, hidden]``: causal attention over whole rows, no cache."""
        cfg = self.cfg
        b, s, _ = x.shape
        q, k, v = self._qkv(x)
        q = q.reshape(b, s, cfg.num_heads, cfg.head_size)
        group = cfg.num_heads // cfg.num_kv_heads  # query head h reads KV head h // group
        k = jnp.repeat(k.reshape(b, s, cfg.num_kv_heads, cfg.head_size), group, axis=2)
        v = jnp.repeat(v.reshape(b, s, cfg.num_kv_heads, cfg.head_size), group, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=jax.lax.Precision.HIGHEST) * cfg.head_size ** -0.5
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf)
        attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v, precision=jax.lax.Precision.HIGHEST)
        return self._mlp(x + self.proj(attn.reshape(b, s, -1)))


class TinyLM(nnx.Module):
    """Token + position embeddings, `Block` s, a final LayerNorm, logits from the tied embedding."""

    def __init__(self, cfg: TinyConfig, *, implementation: str | None = None, interpret: bool = False,
                 rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden, rngs=rngs)
        self.pos_embed = nnx.Embed(cfg.max_len, cfg.hidden, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, implementation=implementation, interpret=interpret, rngs=rngs)
                                for _ in range(cfg.num_layers)])
        self.norm = nnx.LayerNorm(cfg.hidden, rngs=rngs)

    def __call__(self, tokens: Array, positions: Array, kv_caches: list[Array],
                 metadata: jpa.FlashAttentionMetadata) -> tuple[Array, list[Array]]:
        """Packed tokens i32[T] at positions i32[T] -> (logits f32[T, vocab], updated caches)."""
        x = self.embed(tokens) + self.pos_embed(positions)
        new_caches = []
        for block, kv_cache in zip(self.blocks, kv_caches):
            x, kv_cache = block(x, kv_cache, metadata)
            new_caches.append(kv_cache)
        return self.embed.attend(self.norm(x)), new_caches

    def dense(self, tokens: Array) -> Array:
        """Rows of tokens i32[B, S], each from position 0 -> logits f32[B, S, vocab]; no cache."""
        x = self.embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block.dense(x)
        return self.embed.attend(self.norm(x))


def allocate_kv_caches(model: TinyLM, num_blocks: int, block_size: int) -> list[Array]:
    """One zeroed cache per layer, each ``[2, num_blocks, block_size, Hk, D]`` float32."""
    cfg = model.cfg
    return [jpa.allocate_kv_cache(num_blocks, block_size, cfg.num_kv_heads, cfg.head_size, model_dtype=jnp.float32)
            for _ in range(cfg.num_layers)]


def compile_generation(model: TinyLM, *, block_size: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The jitted ``prefill`` and ``decode_loop`` of ``model`` (its parameters passed as arguments)."""
    graphdef, state = nnx.split(model)

    def prefill(state: nnx.State, kv_caches: list[Array], tokens: Array, positions: Array,
                metadata: jpa.FlashAttentionMetadata, last_rows: Array) -> tuple[Array, list[Array]]:
        logits, kv_caches = nnx.merge(graphdef, state)(tokens, positions, kv_caches, metadata)
        return jnp.argmax(logits[last_rows], axis=-1).astype(jnp.int32), kv_caches  # i32[num_seqs]

    def decode_loop(state: nnx.State, kv_caches: list[Array], tokens: Array, positions: Array,
                    metadata: jpa.FlashAttentionMetadata, num_steps: int,
                    num_seqs: int) -> tuple[Array, list[Array]]:
        model = nnx.merge(graphdef, state)

        def step(i: Array, carry: tuple) -> tuple:
            kv_caches, tokens, positions, metadata, out = carry
            logits, kv_caches = model(tokens, positions, kv_caches, metadata)  # one row per decode sequence
            sampled = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            out = out.at[i].set(sampled)
            # Next step's metadata (slots, lengths) from this one; padding rows stay idle.
            metadata, tokens, positions = jpa.advance_step(metadata, sampled, block_size=block_size,
                                                           num_queries=num_seqs)
            return kv_caches, tokens, positions, metadata, out

        out = jnp.zeros((num_steps, tokens.shape[0]), jnp.int32)
        kv_caches, _, _, _, out = jax.lax.fori_loop(0, num_steps, step, (kv_caches, tokens, positions, metadata, out))
        return out, kv_caches  # out: i32[num_steps, padded num_seqs]

    prefill_jit = jax.jit(prefill, donate_argnums=(1,))
    decode_jit = jax.jit(decode_loop, donate_argnums=(1,), static_argnames=("num_steps", "num_seqs"))
    return (lambda *args: prefill_jit(state, *args)), (lambda *args, **kw: decode_jit(state, *args, **kw))


def generate(model: TinyLM, prompts: list[list[int]], max_new_tokens: int, kv_caches: list[Array], *,
             block_size: int = 16) -> tuple[list[list[int]], list[Array]]:
    """Greedy generation of ``max_new_tokens`` per prompt through the paged caches.

    ``kv_caches`` (from `allocate_kv_caches`) are donated: use the returned ones. Each
    prompt owns a contiguous run of blocks enough for its prompt and new tokens.
    """
    num_blocks = int(kv_caches[0].shape[1])
    tables, next_block = [], 0
    for prompt in prompts:
        n = -(-(len(prompt) + max_new_tokens) // block_size)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    if next_block > num_blocks:
        raise ValueError(f"the prompts need {next_block} blocks of {block_size} tokens, the caches hold {num_blocks}.")
    builder = jpa.FlashAttentionMetadataBuilder(block_size=block_size, num_blocks=num_blocks)
    prefill, decode_loop = compile_generation(model, block_size=block_size)

    sequences = [jpa.ScheduledSequence.prompt(len(p), table) for p, table in zip(prompts, tables)]
    metadata = builder.build(sequences)  # prompts packed; counts padded to buckets
    last_rows = np.asarray(metadata.query_start_loc)[sequence_rows(metadata, sequences) + 1] - 1
    first, kv_caches = prefill(kv_caches, pack_per_token(metadata, sequences, prompts),
                               input_positions(metadata, sequences), metadata, last_rows)
    first = np.asarray(first).tolist()
    if max_new_tokens == 1:
        return [[t] for t in first], kv_caches

    # Every sequence now holds its prompt and feeds its first new token: plain decodes.
    sequences = [jpa.ScheduledSequence.decode(len(p) + 1, table) for p, table in zip(prompts, tables)]
    metadata = builder.build(sequences)
    out, kv_caches = decode_loop(kv_caches, pack_per_token(metadata, sequences, [[t] for t in first]),
                                 input_positions(metadata, sequences), metadata,
                                 num_steps=max_new_tokens - 1, num_seqs=len(prompts))
    out = np.asarray(out)
    return [[first[i]] + out[:, i].tolist() for i in range(len(prompts))], kv_caches


def dense_greedy(model: TinyLM, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The reference: every token from ``model.dense`` over the whole row so far, no cache."""
    width = max(len(p) for p in prompts) + max_new_tokens
    rows = np.zeros((len(prompts), width), np.int32)  # right padding: earlier positions never see it
    for i, p in enumerate(prompts):
        rows[i, :len(p)] = p
    graphdef, state = nnx.split(model)
    dense = jax.jit(lambda state, rows: nnx.merge(graphdef, state).dense(rows))
    lengths = np.asarray([len(p) for p in prompts])
    outputs: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        logits = np.asarray(dense(state, rows))
        nxt = logits[np.arange(len(prompts)), lengths - 1].argmax(axis=-1)
        rows[np.arange(len(prompts)), lengths] = nxt
        lengths += 1
        for i, t in enumerate(nxt.tolist()):
            outputs[i].append(int(t))
    return outputs


def main(argv: list[str] | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """Runs the example; returns (paged tokens, dense tokens). Exits 1 if they differ."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=12, help="tokens to generate per prompt")
    parser.add_argument("--implementation", choices=("auto", "xla", "triton"), default="auto",
                        help="attention code (auto: Pallas kernels on a GPU, XLA elsewhere)")
    parser.add_argument("--interpret", action="store_true", help="run the Pallas kernels in interpret mode (CPU)")
    parser.add_argument("--seed", type=int, default=0, help="weights and prompts")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.interpret and args.implementation != "triton":
        parser.error("--interpret runs the Pallas kernels: add --implementation triton")

    cfg = TinyConfig()
    model = TinyLM(cfg, implementation=args.implementation, interpret=args.interpret, rngs=nnx.Rngs(args.seed))
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in (5, 19, 11)]
    if max(len(p) for p in prompts) + args.max_new_tokens > cfg.max_len:
        parser.error(f"--max-new-tokens: prompts + new tokens exceed the model's {cfg.max_len} positions")
    paged, _ = generate(model, prompts, args.max_new_tokens, allocate_kv_caches(model, num_blocks=8, block_size=16))
    dense = dense_greedy(model, prompts, args.max_new_tokens)
    for i, (p, d) in enumerate(zip(paged, dense)):
        print(f"prompt {i} ({len(prompts[i])} tokens): paged {p} {'==' if p == d else '!='} dense {d}")
    if paged != dense:
        raise SystemExit(1)
    return paged, dense


if __name__ == "__main__":
    main()
