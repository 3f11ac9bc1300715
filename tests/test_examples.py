"""The examples run, and do what they say.

* ``examples/generate.py``: usage errors exit with status 2 and a one-line message, no
  traceback, before any model is built; ``--help`` shows defaults and examples; text in,
  text out from a checkpoint with a tokenizer.json (``--stop``, ``--n``); one prompt is one request unless
  ``--num-requests`` says more; ``--interpret`` runs the Pallas kernels.
* ``examples/custom_model_loop.py``: a model of its own with `PagedAttention` layers,
  decoding in its own ``fori_loop`` over `advance_step`, gives the greedy tokens of a
  dense no-cache forward, and updates the donated caches in place.
"""
from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_paged_attn.models
from jax_paged_attn.engine import LLM
from test_llm import checkpoint  # noqa: F401  (fixture: tiny checkpoint + tokenizer.json)

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generate():
    return load_example("generate")


# Small engine settings (the example's defaults work too, at more compile time).
FAST = ["--num-blocks", "24", "--max-num-seqs", "4", "--max-num-batched-tokens", "32"]


# --------------------------------------------------------------------------- generate.py: usage


def test_help_shows_defaults_and_examples(generate, capsys):
    with pytest.raises(SystemExit) as exit_:
        generate.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--max-tokens MAX_TOKENS" in out and "(default: 32)" in out and "(default: auto)" in out
    assert "{auto,xla,triton}" in out and "--interpret" in out and "--num-requests" in out
    assert "examples:\n  python examples/generate.py --verify" in out
    assert "(default: None)" not in out  # options without a default say what happens without them
    assert "0 = greedy (the default)" in out and "--temperature TEMPERATURE" in out


def test_help_answers_before_jax_is_imported():
    """--help parses the arguments before the heavy imports: no JAX, Flax or package module loads."""
    done = subprocess.run([sys.executable, "-X", "importtime", str(EXAMPLES / "generate.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: ")
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "argparse" in imported  # -X importtime listed the imports
    heavy = sorted(m for m in imported if m.split(".")[0] in {"jax", "jaxlib", "flax", "numpy", "jax_paged_attn"})
    assert not heavy, heavy


@pytest.mark.parametrize("args, message", [
    (["--implementation", "cuda"], "argument --implementation: invalid choice: 'cuda'"),
    (["--prompt-ids", "1,2;3,x"], r"--prompt-ids: prompt 1 \('3,x'\) is not a comma-separated list of ints"),
    (["--prompt-ids", "1,2;"], "--prompt-ids: prompt 1 is empty"),
    (["--prompt-ids", "1,256"], r"prompt 0 has ids \[256\] outside the model's vocabulary \[0, 256\)"),
    (["--prompts", "a", "--prompt-ids", "1"], "argument --prompt-ids: not allowed with argument --prompts"),
    (["--max-tokens", "0"], "argument --max-tokens: must be >= 1, got 0"),
    (["--top-p", "1.5"], r"argument --top-p: must be in \(0.0, 1.0\], got 1.5"),
    (["--block-size", "24"], "argument --block-size: must be a multiple of 16, got 24"),
    (["--num-requests", "0"], "argument --num-requests: must be >= 1, got 0"),
    (["--temperature", "hot"], "argument --temperature: must be a number, got 'hot'"),
    (["--interpret", "--implementation", "xla"], "--interpret runs the Pallas kernels"),
    (["--checkpoint", "/nonexistent/dir"], "--checkpoint '/nonexistent/dir' is not a directory"),
    (["--stop", "a", "--stop", ""], "stop strings must not be empty"),
    (["--n", "0"], "argument --n: must be >= 1, got 0"),
])
def test_usage_errors_exit_before_any_model_is_built(generate, monkeypatch, capsys, args, message):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the arguments were checked")

    monkeypatch.setattr(jax_paged_attn.models, "LlamaForCausalLM", no_model)  # generate.main imports it late
    monkeypatch.setattr(LLM, "__init__", no_model)
    monkeypatch.setattr(LLM, "from_model", no_model)
    with pytest.raises(SystemExit) as exit_:
        generate.main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("usage: ")
    assert len(err.strip().splitlines()[-1].split("error: ", 1)) == 2
    assert re.search(message, err), err


def test_checkpoint_usage_errors(generate, checkpoint, tmp_path, monkeypatch, capsys):  # noqa: F811
    directory = checkpoint[0]
    monkeypatch.setattr(LLM, "__init__", lambda *a, **k: pytest.fail("model loaded"))
    shutil.copy(directory / "config.json", tmp_path / "config.json")  # no tokenizer.json, no weights
    with pytest.raises(SystemExit):
        generate.main(["--checkpoint", str(tmp_path), "--prompts", "the cat"])
    assert "has no tokenizer.json: pass token ids with --prompt-ids" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        generate.main(["--checkpoint", str(tmp_path), "--prompt-ids", "1,2", "--stop", "."])
    assert "--stop needs text, and --checkpoint" in capsys.readouterr().err
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(SystemExit):
        generate.main(["--checkpoint", str(tmp_path), "--prompt-ids", "1,2"])
    assert "--checkpoint: " in (err := capsys.readouterr().err) and "model_type 'gpt2'" in err


# --------------------------------------------------------------------------- generate.py: runs


def test_text_in_text_out_from_a_checkpoint(generate, checkpoint, capsys):  # noqa: F811
    directory, tokenizer, _ = checkpoint
    prompts = ["the cat sat on the mat", "a dog ran"]
    llm, outputs = generate.main(["--checkpoint", str(directory), "--prompts", *prompts, "--temperature", "0",
                                  "--max-tokens", "5", "--verify", *FAST])
    assert [o.prompt for o in outputs] == prompts  # one request per prompt
    assert [o.prompt_token_ids for o in outputs] == [tokenizer.encode(p).ids for p in prompts]
    out = capsys.readouterr().out
    for o in outputs:
        (seq,) = o.outputs
        assert seq.text == tokenizer.decode(seq.token_ids, skip_special_tokens=True)
        assert f"{o.prompt!r} -> {seq.text!r}  ({seq.finish_reason}, preempted 0x)" in out
    assert "verify: greedy decoding through the paged cache equals dense no-cache attention for 2/2" in out
    # --stop (repeatable): the text ends before the first stop string; --n: sequences per request.
    first = outputs[0].outputs[0].text.split()
    _, stopped = generate.main(["--checkpoint", str(directory), "--prompts", prompts[0], "--temperature", "0",
                                "--max-tokens", "5", "--stop", "zzz", "--stop", f" {first[1]}", "--n", "2", *FAST])
    (o,) = stopped
    assert [(c.text, c.stop_reason) for c in o.outputs] == [(first[0], f" {first[1]}")] * 2
    out = capsys.readouterr().out
    assert all(f"[{o.request_id}, {j}] {prompts[0]!r} -> {first[0]!r}  (stop ' {first[1]}'" in out for j in (0, 1))


def test_one_prompt_is_one_request_unless_told(generate, checkpoint, tmp_path, caplog):  # noqa: F811
    for name in ("model.safetensors", "tokenizer.json"):
        shutil.copy(checkpoint[0] / name, tmp_path / name)
    hf_config = json.loads((checkpoint[0] / "config.json").read_text())
    del hf_config["dtype"], hf_config["torch_dtype"]  # names no dtype: the fallback is said once
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    caplog.set_level("WARNING", logger="jax_paged_attn")
    llm, outputs = generate.main(["--checkpoint", str(tmp_path), "--prompt-ids", "1,5,6", "--max-tokens", "3",
                                  *FAST])
    assert [o.prompt_token_ids for o in outputs] == [[1, 5, 6]]
    assert [r.getMessage().split(" names no dtype")[0] for r in caplog.records] == [str(tmp_path / "config.json")]
    assert llm.model.dtype == jnp.float32  # the tensors' dtype

    directory = str(checkpoint[0])
    _, outputs = generate.main(["--checkpoint", directory, "--prompt-ids", "1,5,6;2,7", "--num-requests", "3",
                                "--max-tokens", "3", *FAST])
    assert [o.prompt_token_ids for o in outputs] == [[1, 5, 6], [2, 7], [1, 5, 6]]
    assert all(o.outputs[0].text is not None for o in outputs)  # the checkpoint's tokenizer decodes id prompts' outputs


def test_interpret_runs_the_pallas_kernels(generate, checkpoint, capsys):  # noqa: F811
    llm, outputs = generate.main(["--checkpoint", str(checkpoint[0]), "--interpret", "--prompts", "the red house",
                                  "--max-tokens", "3", "--verify", *FAST])
    attn = llm.model.model.layers[0].self_attn.attn
    assert attn.implementation == "triton" and attn.interpret
    assert "attention triton (interpret)" in (out := capsys.readouterr().out) and "for 1/1 requests" in out


# --------------------------------------------------------------------------- custom_model_loop.py


def test_custom_model_loop_matches_dense_and_donates_the_caches(capsys):
    example = load_example("custom_model_loop")
    paged, dense = example.main(["--max-new-tokens", "10"])
    assert paged == dense and all(len(t) == 10 for t in paged)
    assert "== dense" in capsys.readouterr().out

    model = example.TinyLM(example.TinyConfig(), rngs=nnx.Rngs(7))
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, model.cfg.vocab_size, size=n).tolist() for n in (3, 30, 14)]  # decodes cross blocks
    caches = example.allocate_kv_caches(model, num_blocks=8, block_size=16)
    pointers = [c.unsafe_buffer_pointer() for c in caches]
    tokens, new_caches = example.generate(model, prompts, 9, caches)
    assert all(c.is_deleted() for c in caches), "the caches were not donated"
    assert [c.unsafe_buffer_pointer() for c in new_caches] == pointers, "a cache was copied"
    assert tokens == example.dense_greedy(model, prompts, 9)
    written = np.asarray(new_caches[0][0]).reshape(-1, *new_caches[0].shape[3:])  # [slots, Hk, D] keys
    used = sum(len(p) + 9 - 1 for p in prompts)  # every token but the last new one was written
    assert np.count_nonzero(np.abs(written).sum(axis=(1, 2))) == used
