#!/usr/bin/env python3
"""Hugging Face transformers generation on the same model shape: what a user would run
instead of our engine (torch bf16, random weights, greedy, EOS never ends a sequence).

    python benchmarks/bench_hf.py [--batches 1,32,256] [--prompt-len 128] [--new-tokens 128]
                                  [--modes static_compile,generate_batch] [--json OUT]

Modes (each where the installed transformers has it; a mode that fails prints why):

* ``static_compile``: ``model.generate`` with ``cache_implementation="static"``, whose
  decoding transformers compiles with ``torch.compile`` (CUDA graphs); decode tok/s =
  ``B * (N - 1) / (t(N new tokens) - t(1 new token))`` after a warm-up of each.
* ``dynamic``: plain ``model.generate`` (dynamic cache, eager), the same measure.
* ``generate_batch``: transformers' continuous batching (``model.generate_batch``);
  end-to-end generated tok/s (prefill included).

Run on a machine with torch and a CUDA GPU; `bench_engine.py --hf` runs it in a
subprocess (so torch and JAX do not share the GPU's memory pool) and prints its figures
beside the engine's.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Sequence

LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096)


def _timed(fn: Any) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_generate(model: Any, batch: int, prompt_len: int, new_tokens: int, **kwargs: Any) -> dict[str, float]:
    import torch

    ids = torch.randint(0, LLAMA_1B["vocab_size"], (batch, prompt_len), device="cuda")
    mask = torch.ones_like(ids)

    def run(n: int) -> None:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, **kwargs)
        assert out.shape[1] == prompt_len + n, out.shape

    run(new_tokens)  # compiles (static cache) / warms up
    run(1)
    full = min(_timed(lambda: run(new_tokens)) for _ in range(2))
    first = min(_timed(lambda: run(1)) for _ in range(2))
    decode = batch * (new_tokens - 1) / max(full - first, 1e-9)
    return dict(decode_tok_s=decode, e2e_tok_s=batch * new_tokens / full, ms_per_step=1e3 * (full - first) / (new_tokens - 1))


def bench_generate_batch(model: Any, batch: int, prompt_len: int, new_tokens: int) -> dict[str, float]:
    import torch
    from transformers import GenerationConfig

    prompts = torch.randint(0, LLAMA_1B["vocab_size"], (batch, prompt_len)).tolist()
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=-1, pad_token_id=0)
    model.generate_batch(inputs=prompts, generation_config=config)  # warm-up
    wall = _timed(lambda: model.generate_batch(inputs=prompts, generation_config=config))
    return dict(e2e_tok_s=batch * new_tokens / wall)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--batches", default="1,32,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--modes", default="static_compile,dynamic,generate_batch")
    parser.add_argument("--json", default=None, help="write the results here as JSON")
    args = parser.parse_args(argv)

    import torch
    import transformers

    if not torch.cuda.is_available():
        sys.exit("bench_hf.py needs a CUDA GPU (torch.cuda.is_available() is False).")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**LLAMA_1B)
    model = transformers.LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    results: dict[str, Any] = dict(transformers=transformers.__version__, torch=torch.__version__,
                                   device=torch.cuda.get_device_name(), rows=[])
    print(f"# Hugging Face transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{results['device']}, bf16, prompt {args.prompt_len}, {args.new_tokens} new tokens", flush=True)
    for batch in [int(b) for b in args.batches.split(",")]:
        for mode in args.modes.split(","):
            start = time.perf_counter()
            try:
                # generate_batch refuses tensors made under inference_mode: no_grad instead.
                with torch.no_grad():
                    if mode == "static_compile":
                        row = bench_generate(model, batch, args.prompt_len, args.new_tokens,
                                             cache_implementation="static")
                    elif mode == "dynamic":
                        row = bench_generate(model, batch, args.prompt_len, args.new_tokens)
                    elif mode == "generate_batch":
                        if not hasattr(model, "generate_batch"):
                            raise NotImplementedError("this transformers has no generate_batch")
                        row = bench_generate_batch(model, batch, args.prompt_len, args.new_tokens)
                    else:
                        raise ValueError(f"unknown mode {mode!r}")
            except Exception as e:  # a mode the installed version lacks: say so, go on
                row = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            row.update(batch=batch, mode=mode, wall_s=time.perf_counter() - start)
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
