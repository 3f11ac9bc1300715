#!/usr/bin/env python3
"""Generate text for a batch of prompts with `LLMEngine` (paged KV cache, continuous batching).

Default: a small random-weight Llama with a byte-level "tokenizer" (token id = byte
value) on the CPU: the generations are gibberish, the point is the engine at work::

    python examples/generate.py --max-tokens 32 --temperature 0.8 --top-p 0.95
    python examples/generate.py --num-blocks 12 --max-tokens 48   # tiny cache: preemption

A Hugging Face Llama / Mistral checkpoint directory (config.json + *.safetensors, read
locally, no download) runs on whatever backend JAX has; without a tokenizer, pass token
ids::

    python examples/generate.py --checkpoint /path/to/model --prompt-ids "1,15043,29892" --dtype bfloat16
"""
from __future__ import annotations

import argparse
import pathlib
import sys

# Run as a script from anywhere: make the working tree's jax_paged_attn importable.
_REPO = pathlib.Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jax_paged_attn.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from jax_paged_attn.models import dense_greedy_generate  # noqa: E402
from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM, load_llama  # noqa: E402

DEFAULT_PROMPTS = [
    "The paged KV cache stores keys and values in blocks of",
    "Continuous batching lets new requests join",
    "Hello, my name is",
    "JAX compiles a program once per",
]

# Byte-level vocabulary: small enough that the random model runs in seconds on a CPU.
RANDOM_MODEL = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           max_position_embeddings=1024)


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(token_ids: list[int]) -> str:
    return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="Hugging Face checkpoint directory (config.json + safetensors)")
    parser.add_argument("--prompts", nargs="*", help="prompt strings (byte-level tokens)")
    parser.add_argument("--prompt-ids", help="token-id prompts: '1,2,3;4,5' (';' separates prompts)")
    parser.add_argument("--batch-size", type=int, default=8, help="number of requests (prompts are cycled)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--top-k", type=int, default=-1, help="-1 = off")
    parser.add_argument("--num-blocks", type=int, default=64, help="KV-cache blocks (small values force preemption)")
    parser.add_argument("--num-host-blocks", type=int, default=None, help="host swap blocks (default: num-blocks)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=128, help="token budget of one step")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--implementation", default=None, help="attention implementation: auto, xla, triton")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verify", action="store_true",
                        help="also decode greedily through the engine and through a dense no-cache forward, "
                             "and check they agree token for token (exits 1 if not)")
    args = parser.parse_args(argv)

    dtype = jnp.dtype(args.dtype)
    if args.checkpoint:
        model = load_llama(args.checkpoint, dtype=dtype, implementation=args.implementation)
    else:
        model = LlamaForCausalLM(RANDOM_MODEL, rngs=nnx.Rngs(args.seed), dtype=dtype, param_dtype=dtype,
                                 implementation=args.implementation)
    byte_level = not args.checkpoint
    if args.prompt_ids:
        prompts = [[int(t) for t in p.split(",") if t.strip()] for p in args.prompt_ids.split(";")]
        byte_level = False
    else:
        if args.checkpoint:
            parser.error("--checkpoint needs --prompt-ids (this example has no tokenizer for real models).")
        prompts = [encode(p) for p in (args.prompts or DEFAULT_PROMPTS)]
    prompts = [prompts[i % len(prompts)] for i in range(max(args.batch_size, 1))]

    engine = LLMEngine(model, EngineConfig(
        num_blocks=args.num_blocks, block_size=args.block_size, num_host_blocks=args.num_host_blocks,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens)
    # Distinct seeds per request (the engine derives them), so equal prompts may differ.
    outputs = engine.generate(prompts, params)

    print(f"backend: {jax.default_backend()}, model: {model.config.num_hidden_layers} layers, "
          f"hidden {model.config.hidden_size}, vocab {model.config.vocab_size}, {args.dtype}")
    for out in outputs:
        if byte_level:
            print(f"[{out.request_id}] {decode(out.prompt_token_ids)!r} -> {decode(out.output_token_ids)!r}"
                  f"  ({out.finish_reason}, preempted {out.num_preemptions}x)")
        else:
            print(f"[{out.request_id}] {out.prompt_token_ids} -> {out.output_token_ids}  ({out.finish_reason})")
    print(engine.stats.summary())

    if args.verify:
        greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        paged = [out.output_token_ids for out in engine.generate(prompts, greedy, use_tqdm=False)]
        dense = dense_greedy_generate(model, prompts, args.max_tokens)
        same = sum(p == d for p, d in zip(paged, dense))
        print(f"verify: greedy decoding through the paged cache equals dense no-cache attention for "
              f"{same}/{len(prompts)} requests")
        if same != len(prompts):
            sys.exit(1)


if __name__ == "__main__":
    main()
