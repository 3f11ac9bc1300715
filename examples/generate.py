#!/usr/bin/env python3
"""Generate text for a batch of prompts with `LLM` (paged KV cache, continuous batching).

Without --checkpoint: a small random-weight Llama with a byte-level tokenizer (one token
per byte) on whatever backend JAX has (the CPU by default): the generations are
gibberish, the point is the engine at work. With --checkpoint: a Hugging Face Llama /
Mistral directory (config.json + *.safetensors, read locally, no download); text prompts
need its tokenizer.json, --prompt-ids work without one.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
from typing import TYPE_CHECKING, Callable

# Run as a script from anywhere: make the working tree's jax_paged_attn importable.
_REPO = pathlib.Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

# JAX and the package are imported by `main` after the arguments are parsed, so --help
# and usage errors answer at once instead of after seconds of imports.
if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from jax_paged_attn.engine import LLM, Logprob, RequestOutput

DEFAULT_PROMPTS = [
    "The paged KV cache stores keys and values in blocks of",
    "Continuous batching lets new requests join",
    "Hello, my name is",
    "JAX compiles a program once per",
]

# `LlamaConfig` fields of the random model. Byte-level vocabulary: small enough that the
# model runs in seconds on a CPU.
RANDOM_MODEL = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024)

EPILOG = """examples:
  python examples/generate.py --verify                          # random model; greedy paged == dense?
  python examples/generate.py --max-tokens 32 --temperature 0.8 --top-p 0.95
  python examples/generate.py --num-blocks 12 --max-tokens 48 --num-requests 8   # tiny cache: preemption
  python examples/generate.py --implementation triton --interpret --max-tokens 4  # Pallas kernels on a CPU
  python examples/generate.py --checkpoint /path/to/Llama-3.2-1B --prompts "The capital of France is"
  python examples/generate.py --checkpoint /path/to/model --prompt-ids "1,15043,29892;1,450"
  python examples/generate.py --checkpoint /path/to/model --prompts "Count: 1, 2," --stop " 5" --stop "."
"""


def byte_tokenizer() -> "Tokenizer":
    """A `tokenizers.Tokenizer` with one token per byte (256 tokens): any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _block_size(text: str) -> int:
    value = _int_at_least(16)(text)
    if value % 16:
        raise argparse.ArgumentTypeError(f"must be a multiple of 16, got {value}")
    return value


def _float_in(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not (low < value if low_open else low <= value) or not value <= high:
            raise argparse.ArgumentTypeError(
                f"must be in {'(' if low_open else '['}{low}, {high}], got {value}")
        return value

    return parse


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows every default and keeps the examples' line breaks. An option whose default
    is None or False says in its own help what happens without it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help or ""
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, epilog=EPILOG, formatter_class=_HelpFormatter)
    parser.add_argument("--checkpoint", metavar="DIR",
                        help="Hugging Face checkpoint directory (config.json + safetensors [+ tokenizer.json]); "
                             "without it: a random-weight model with a byte-level tokenizer")
    prompts = parser.add_mutually_exclusive_group()
    prompts.add_argument("--prompts", nargs="+", metavar="TEXT",
                         help="text prompts; without it (and --prompt-ids): four built-in ones")
    prompts.add_argument("--prompt-ids", metavar="IDS",
                         help="token-id prompts: '1,2,3;4,5' (';' separates prompts)")
    parser.add_argument("--num-requests", type=_int_at_least(1), metavar="N",
                        help="requests to run, cycling through the prompts; without it: one per prompt")
    parser.add_argument("--max-tokens", type=_int_at_least(1), default=32, help="tokens to generate per request")
    parser.add_argument("--temperature", type=_float_in(0.0, float("inf")), default=0.0,
                        help="0 = greedy (the default); > 0 samples at that temperature")
    parser.add_argument("--top-p", type=_float_in(0.0, 1.0, low_open=True), default=1.0,
                        help="nucleus sampling (with --temperature > 0): keep the most likely tokens up to "
                             "this mass; 1 = off")
    parser.add_argument("--top-k", type=_int_at_least(-1), default=-1, help="-1 = off")
    parser.add_argument("--stop", action="append", metavar="TEXT",
                        help="stop string (repeat for several): a request ends when its text holds one, and "
                             "its text ends before it; needs a tokenizer; without it: none")
    parser.add_argument("--n", type=_int_at_least(1), default=1, help="sequences sampled per request")
    parser.add_argument("--logprobs", type=_int_at_least(0), metavar="K",
                        help="also print each generated token's logprob and rank and the top K alternatives "
                             "(K <= 20); without it: none")
    parser.add_argument("--seed", type=_int_at_least(0), default=0,
                        help="sampling seed (and the random model's weights)")
    parser.add_argument("--num-blocks", type=_int_at_least(1), default=64,
                        help="KV-cache blocks (small values force preemption)")
    parser.add_argument("--num-host-blocks", type=_int_at_least(0), default=None,
                        help="host swap blocks; without it: the engine's default (up to 4 GiB)")
    parser.add_argument("--block-size", type=_block_size, default=16, help="tokens per block, a multiple of 16")
    parser.add_argument("--max-num-seqs", type=_int_at_least(1), default=8, help="requests running at once")
    parser.add_argument("--max-num-batched-tokens", type=_int_at_least(1), default=128,
                        help="token budget of one step")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="compute dtype; auto: the checkpoint's (float32 for the random model)")
    parser.add_argument("--implementation", default="auto", choices=("auto", "xla", "triton"),
                        help="attention code: auto (Pallas kernels on a GPU, XLA elsewhere), xla, triton")
    parser.add_argument("--interpret", action="store_true",
                        help="run the Pallas Triton kernels in interpret mode (works on a CPU; implies "
                             "--implementation triton)")
    parser.add_argument("--verify", action="store_true",
                        help="also decode greedily through the engine and through a dense no-cache forward, "
                             "and check they agree token for token (exits 1 if not)")
    return parser


def _parse_prompt_ids(parser: argparse.ArgumentParser, text: str, vocab_size: int) -> list[list[int]]:
    prompts = []
    for i, part in enumerate(text.split(";")):
        try:
            ids = [int(t) for t in part.split(",") if t.strip()]
        except ValueError:
            parser.error(f"--prompt-ids: prompt {i} ({part.strip()!r}) is not a comma-separated list of ints")
        if not ids:
            parser.error(f"--prompt-ids: prompt {i} is empty")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            parser.error(f"--prompt-ids: prompt {i} has ids {bad[:5]} outside the model's vocabulary [0, {vocab_size})")
        prompts.append(ids)
    return prompts


def _format_logprobs(token: int, entry: dict[int, Logprob], k: int) -> str:
    """``'tok' -1.23 (rank 2) [top: 'a' -0.90, ...]`` for one generated token (its
    ``CompletionOutput.logprobs`` entry: the top ``k`` first, then the token if not among them)."""
    def name(token_id: int) -> str:
        text = entry[token_id].decoded_token
        return repr(text) if text is not None else str(token_id)

    top = ", ".join(f"{name(t)} {lp.logprob:.2f}" for t, lp in list(entry.items())[:k])
    return f"{name(token)} {entry[token].logprob:.2f} (rank {entry[token].rank})" + (f" [top: {top}]" if k else "")


def main(argv: list[str] | None = None) -> tuple[LLM, list[RequestOutput]]:
    """Runs the example; returns the `LLM` and its outputs.

    Raises SystemExit: 2 on a usage error (reported before any model is built), 1 when
    --verify finds a difference.
    """
    parser = build_parser()
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jax_paged_attn.engine import LLM, EngineConfig, SamplingParams
    from jax_paged_attn.engine.llm import TOKENIZER_FILE
    from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM, checkpoint_dtype, dense_greedy_generate
    from jax_paged_attn.models.checkpoint import read_config

    # Every usage error is reported here, before a model is built or loaded.
    implementation = args.implementation
    if args.interpret:
        if implementation == "xla":
            parser.error("--interpret runs the Pallas kernels: it needs --implementation triton (or auto)")
        implementation = "triton"
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, logprobs=args.logprobs, stop=args.stop or (),
                                n=args.n)
        engine_options = dict(
            num_blocks=args.num_blocks, block_size=args.block_size, num_host_blocks=args.num_host_blocks,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed)
        EngineConfig(**engine_options)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    has_tokenizer = True
    config = LlamaConfig(**RANDOM_MODEL)
    dtype = jnp.dtype(jnp.float32 if args.dtype == "auto" else args.dtype)
    if args.checkpoint:
        if not os.path.isdir(args.checkpoint):
            parser.error(f"--checkpoint {args.checkpoint!r} is not a directory")
        try:
            config = read_config(args.checkpoint)
            if args.dtype == "auto":
                dtype = checkpoint_dtype(args.checkpoint)  # logs once if the checkpoint names none
        except (OSError, ValueError) as e:
            parser.error(f"--checkpoint: {e}")
        has_tokenizer = os.path.isfile(os.path.join(args.checkpoint, TOKENIZER_FILE))
        if not has_tokenizer and not args.prompt_ids:
            parser.error(f"--checkpoint {args.checkpoint!r} has no {TOKENIZER_FILE}: pass token ids with --prompt-ids")
        if not has_tokenizer and args.stop:
            parser.error(f"--stop needs text, and --checkpoint {args.checkpoint!r} has no {TOKENIZER_FILE}")
    if args.prompt_ids:
        prompts: list[str] | list[list[int]] = _parse_prompt_ids(parser, args.prompt_ids, config.vocab_size)
    else:
        prompts = args.prompts or DEFAULT_PROMPTS
    num_requests = args.num_requests or len(prompts)
    prompts = [prompts[i % len(prompts)] for i in range(num_requests)]

    if args.checkpoint:
        llm = LLM(args.checkpoint, dtype=dtype, implementation=implementation, interpret=args.interpret,
                  tokenizer="auto" if has_tokenizer else None, **engine_options)
    else:
        model = LlamaForCausalLM(config, rngs=nnx.Rngs(args.seed), dtype=dtype, param_dtype=dtype,
                                 implementation=implementation, interpret=args.interpret)
        llm = LLM.from_model(model, tokenizer=byte_tokenizer(), **engine_options)
    model = llm.model
    try:
        # Requests without a seed get distinct ones from the engine, so equal prompts may differ.
        outputs = llm.generate(prompts, params)
    except ValueError as e:  # a prompt the model cannot take (too long for its context, ...)
        parser.exit(2, f"{parser.prog}: error: {e}\n")

    print(f"backend: {jax.default_backend()}, model: {model.config.num_hidden_layers} layers, "
          f"hidden {model.config.hidden_size}, vocab {model.config.vocab_size}, {jnp.dtype(model.dtype).name}, "
          f"attention {implementation}{' (interpret)' if args.interpret else ''}; requests: {len(outputs)}")
    for out in outputs:  # vLLM's shape: a RequestOutput per prompt, a CompletionOutput per sequence
        prompt = out.prompt if out.prompt is not None else out.prompt_token_ids
        for seq in out.outputs:
            name = out.request_id if len(out.outputs) == 1 else f"{out.request_id}, {seq.index}"
            generated = seq.text if seq.text is not None else seq.token_ids
            stop = "" if seq.stop_reason is None else f" {seq.stop_reason!r}"
            print(f"[{name}] {prompt!r} -> {generated!r}  ({seq.finish_reason}{stop}, "
                  f"preempted {out.num_preemptions}x)")
            if seq.logprobs is not None:
                print(f"    cumulative logprob {seq.cumulative_logprob:.3f}; per token: "
                      + "; ".join(_format_logprobs(token, entry, args.logprobs)
                                  for token, entry in zip(seq.token_ids, seq.logprobs)))
    print(llm.engine.stats.summary())

    if args.verify:
        greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        paged = llm.generate(prompts, greedy, use_tqdm=False)
        dense = dense_greedy_generate(model, [out.prompt_token_ids for out in paged], args.max_tokens)
        same = sum(out.outputs[0].token_ids == d for out, d in zip(paged, dense))
        print(f"verify: greedy decoding through the paged cache equals dense no-cache attention for "
              f"{same}/{len(prompts)} requests")
        if same != len(prompts):
            raise SystemExit(1)
    return llm, outputs


if __name__ == "__main__":
    main()
