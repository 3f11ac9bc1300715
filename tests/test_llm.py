"""`LLM`: text in, text out over the engine, with a checkpoint's tokenizer.json.

The checkpoint is a tiny random-weight Llama written by `save_checkpoint`; the tokenizer
is a word-level one trained here with Hugging Face's ``tokenizers`` (BOS added by its
post-processor, like Llama's). Generated ids must be the dense greedy reference's and
the text the tokenizer's decoding of them.
"""
from __future__ import annotations

import shutil

import jax.numpy as jnp
import pytest
from flax import nnx
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from jax_paged_attn.engine import LLM, LLMOutput, SamplingParams
from jax_paged_attn.models import dense_greedy_generate
from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM, save_checkpoint

CORPUS = ["the cat sat on the mat", "a dog ran to the red house", "my name is jax and i like paged caches"]
# Small shared shapes (see tests/test_engine.py): few programs to compile on a CPU.
ENGINE = dict(num_blocks=24, block_size=16, max_num_seqs=4, max_num_batched_tokens=32, num_host_blocks=8,
              batch_buckets=(4,), token_buckets=(32,), block_table_width_buckets=(4,), coarse_length_bounds=True,
              compiler_options={"xla_backend_optimization_level": 0})


def word_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(CORPUS, trainer=trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "</s>"]))
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    return tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory with config.json + model.safetensors + tokenizer.json, the tokenizer, the model)."""
    directory = tmp_path_factory.mktemp("tiny_llama")
    tokenizer = word_tokenizer()
    config = LlamaConfig.tiny(vocab_size=tokenizer.get_vocab_size())
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(1), implementation="xla")
    save_checkpoint(model, config, directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory, tokenizer, model


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def test_text_in_text_out_from_a_checkpoint(checkpoint):
    directory, tokenizer, _ = checkpoint
    llm = LLM(directory, implementation="xla", **ENGINE)
    assert llm.model.dtype == jnp.float32  # the checkpoint's dtype ("auto")
    prompts = ["the cat sat on the mat", "a dog ran"]
    outs = llm.generate(prompts, greedy(6), use_tqdm=False)
    ids = [tokenizer.encode(p).ids for p in prompts]
    assert all(p[0] == tokenizer.token_to_id("<s>") for p in ids)  # the BOS the tokenizer adds
    expected = dense_greedy_generate(llm.model, ids, 6)
    assert all(isinstance(o, LLMOutput) for o in outs)
    assert [o.prompt for o in outs] == prompts
    assert [o.prompt_token_ids for o in outs] == ids
    assert [o.output_token_ids for o in outs] == expected
    assert [o.text for o in outs] == [tokenizer.decode(e, skip_special_tokens=True) for e in expected]
    assert all(o.text for o in outs) and all(o.finish_reason == "length" for o in outs)
    assert [o.request_output.output_token_ids for o in outs] == expected
    # Token-id prompts give the same generation; both kinds may share one call.
    again = llm.generate([ids[0], prompts[1]], greedy(6), use_tqdm=False)
    assert [o.output_token_ids for o in again] == expected and [o.prompt for o in again] == [None, prompts[1]]
    assert llm.encode(prompts[1]) == ids[1] and llm.decode(ids[1]) == prompts[1]  # BOS skipped


def test_without_a_tokenizer_prompts_are_token_ids(checkpoint, tmp_path, caplog):
    directory, tokenizer, model = checkpoint
    for name in ("config.json", "model.safetensors"):  # the same checkpoint without tokenizer.json
        shutil.copy(directory / name, tmp_path / name)
    caplog.set_level("WARNING", logger="jax_paged_attn")
    llm = LLM(tmp_path, implementation="xla", **ENGINE)
    assert llm.tokenizer is None
    assert len(caplog.records) == 1 and "no tokenizer.json in" in caplog.records[0].getMessage()
    (out,) = llm.generate([[1, 5, 6]], greedy(4), use_tqdm=False)
    assert out.text is None and out.output_token_ids == dense_greedy_generate(model, [[1, 5, 6]], 4)[0]
    with pytest.raises(ValueError, match=r"prompts\[1\] is text, but this LLM has no tokenizer"):
        llm.generate([[1, 2], "the cat"], greedy(4), use_tqdm=False)

    with_tokenizer = LLM.from_model(model, tokenizer=directory, **ENGINE)  # a directory holding tokenizer.json
    assert with_tokenizer.encode("the cat") == tokenizer.encode("the cat").ids
    assert LLM.from_model(model, tokenizer=tokenizer).tokenizer is tokenizer


def test_a_missing_checkpoint_is_said_once(tmp_path, caplog):
    caplog.set_level("WARNING", logger="jax_paged_attn")
    with pytest.raises(FileNotFoundError, match=r"checkpoint directory '.*does-not-exist' does not exist\.$"):
        LLM(tmp_path / "does-not-exist")
    with pytest.raises(FileNotFoundError, match=r"no config\.json in checkpoint directory"):
        LLM(tmp_path)  # exists, but holds no checkpoint
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(NotADirectoryError, match="is a file, not a directory"):
        LLM(tmp_path / "config.json")
    assert not caplog.records  # no tokenizer warning before (or besides) the error


def test_bad_arguments_are_named(checkpoint):
    directory, _, model = checkpoint
    with pytest.raises(TypeError, match=r"unknown engine option\(s\) \['num_block'\]"):
        LLM(directory, num_block=8)
    with pytest.raises(TypeError, match="tokenizer must be None, a path"):
        LLM.from_model(model, tokenizer=42)
    with pytest.raises(FileNotFoundError, match="no tokenizer file"):
        LLM.from_model(model, tokenizer=directory / "missing.json")
    llm = LLM.from_model(model, **ENGINE)
    with pytest.raises(TypeError, match=r"prompts must be a list .*\[prompt\]"):
        llm.generate("the cat", greedy(2))
    with pytest.raises(TypeError, match=r"prompts\[0\] must be a text or a list of token ids"):
        llm.generate([3.5], greedy(2))
    with pytest.raises(ValueError, match="cannot encode text: this LLM has no tokenizer"):
        llm.encode("the cat")
