"""`LLM`: text in, text out over the engine, with a checkpoint's tokenizer.json.

The checkpoint is a tiny random-weight Llama written by `save_checkpoint`; the tokenizer
is a word-level one trained here with Hugging Face's ``tokenizers`` (BOS added by its
post-processor, like Llama's). Generated ids must be the dense greedy reference's and
the text the tokenizer's decoding of them.

Then vLLM's text layer over one module-scoped `LLM` (`vocab_llm`): special tokens named
only by tokenizer_config.json / special_tokens_map.json skipped in text (kept with
``skip_special_tokens=False``), stop strings across token boundaries, stop ids'
``stop_reason``, ``n`` samples per prompt, and the refusals where there is no text.
"""
from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from conftest import ENGINE_GROUP
from jax_paged_attn.engine import LLM, CompletionOutput, RequestOutput, SamplingParams, load_tokenizer
from jax_paged_attn.models import dense_greedy_generate
from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM, save_checkpoint

pytestmark = ENGINE_GROUP  # one worker compiles the tiny Llama's programs once (conftest.py)

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
    assert all(isinstance(o, RequestOutput) and o.finished for o in outs)
    assert [o.prompt for o in outs] == prompts
    assert [o.prompt_token_ids for o in outs] == ids
    seqs = [o.outputs[0] for o in outs]
    assert all(isinstance(c, CompletionOutput) for c in seqs) and [len(o.outputs) for o in outs] == [1, 1]
    assert [c.token_ids for c in seqs] == expected
    assert [c.text for c in seqs] == [tokenizer.decode(e, skip_special_tokens=True) for e in expected]
    assert all(c.text for c in seqs) and all(c.finish_reason == "length" and c.stop_reason is None for c in seqs)
    assert all(c.index == 0 and c.logprobs is None and c.cumulative_logprob is None for c in seqs)
    # Token-id prompts give the same generation; both kinds may share one call.
    again = llm.generate([ids[0], prompts[1]], greedy(6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == expected and [o.prompt for o in again] == [None, prompts[1]]
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
    assert out.prompt is None and out.outputs[0].text is None
    assert out.outputs[0].token_ids == dense_greedy_generate(model, [[1, 5, 6]], 4)[0]
    with pytest.raises(ValueError, match=r"prompts\[1\] is text, but this LLM has no tokenizer"):
        llm.generate([[1, 2], "the cat"], greedy(4), use_tqdm=False)

    with_tokenizer = LLM.from_model(model, tokenizer=directory, **ENGINE)  # a directory holding tokenizer.json
    assert with_tokenizer.encode("the cat") == tokenizer.encode("the cat").ids
    assert LLM.from_model(model, tokenizer=tokenizer).tokenizer is tokenizer


def test_prompts_and_the_checkpoint_argument_take_vllms_forms(checkpoint):
    directory, tokenizer, _ = checkpoint
    llm = LLM(model=str(directory), implementation="xla", **ENGINE)  # vLLM's keyword
    text = "the cat sat"
    ids = tokenizer.encode(text).ids
    (reference,) = llm.generate([text], greedy(4), use_tqdm=False)
    (one,) = llm.generate(text, greedy(4), use_tqdm=False)  # one prompt, not a list
    (tokens,) = llm.generate(ids, greedy(4), use_tqdm=False)  # one prompt's token ids
    (as_dict,) = llm.generate({"prompt": text, "cache_salt": "tenant-a"}, greedy(4), use_tqdm=False)
    (ids_dict,) = llm.generate([{"prompt_token_ids": ids}], greedy(4), use_tqdm=False)
    for out in (one, tokens, as_dict, ids_dict):
        assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    assert one.prompt == as_dict.prompt == text and tokens.prompt is None and tokens.prompt_token_ids == ids
    assert as_dict.num_cached_tokens == 0  # the only request salted "tenant-a" so far
    with pytest.raises(ValueError, match=r"prompts\[1\] is an empty text"):
        llm.generate(["the cat", ""], greedy(2), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[0\] must hold exactly one of 'prompt'"):
        llm.generate([{"prompt": text, "prompt_token_ids": ids}], greedy(2), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[0\] has unknown key\(s\) \['promt'\]"):
        llm.generate({"promt": text}, greedy(2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert LLM(checkpoint_dir=directory, implementation="xla", **ENGINE).tokenizer is not None  # the older name
    with pytest.raises(TypeError, match="LLM takes the checkpoint directory once"):
        LLM(directory, checkpoint_dir=directory)
    with pytest.raises(TypeError, match="for a model already built use LLM.from_model"):
        LLM(llm.model)


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
    devices = len(jax.devices())  # tests/test_parallel.py runs tensor_parallel_size=2 on forced CPU devices
    with pytest.raises(ValueError, match=rf"tensor_parallel_size must be an int in \[1, {devices}\].*got {devices + 1}"):
        LLM(directory, tensor_parallel_size=devices + 1, **ENGINE)
    with pytest.raises(TypeError, match="tokenizer must be None, a path"):
        LLM.from_model(model, tokenizer=42)
    with pytest.raises(FileNotFoundError, match="no tokenizer file"):
        LLM.from_model(model, tokenizer=directory / "missing.json")
    llm = LLM.from_model(model, **ENGINE)
    with pytest.raises(ValueError, match=r"prompts\[0\] is text, but this LLM has no tokenizer"):
        llm.generate("the cat", greedy(2))  # one prompt, as vLLM takes it
    with pytest.raises(TypeError, match=r"prompts\[0\] must be a text, a list or 1-D integer array of token ids"):
        llm.generate([3.5], greedy(2))
    with pytest.raises(TypeError, match="prompts must be a text, token ids, a dict prompt or a list of them"):
        llm.generate(42, greedy(2))
    with pytest.raises(ValueError, match="cannot encode text: this LLM has no tokenizer"):
        llm.encode("the cat")


# --------------------------------------------------------------------------- special tokens, stop strings, n


@pytest.fixture(scope="module")
def vocab_llm(checkpoint, tmp_path_factory):
    """An `LLM` over the checkpoint's model with a word tokenizer of its own whose
    tokenizer.json marks nothing special: tokenizer_config.json names ``eos_token`` (a
    string), ``bos_token`` (an AddedToken object) and an ``added_tokens_decoder`` entry,
    special_tokens_map.json an additional special token. Every other id ``i`` is the
    word ``w{i}``. The ids are picked from the model's greedy output for `SPECIAL_PROMPT`
    so it produces ``<extra>`` second and stops on ``</s>`` fourth.

    Returns (llm, {name: id}).
    """
    _, _, model = checkpoint
    reference = dense_greedy_generate(model, [SPECIAL_PROMPT, STOP_PROMPT], 12)
    said = reference[0][:4]
    assert said[3] not in said[:3] and said[1] != said[3], f"the model's greedy output changed: {said}"
    vocab_size = model.config.vocab_size
    free = [i for i in range(vocab_size) if i not in said and i not in reference[1]]
    ids = {"<extra>": said[1], "</s>": said[3], "<s>": free[-1], "<pad>": free[-2]}
    words = {f"w{i}": i for i in range(vocab_size)}
    words.update(ids)
    words = {w: i for w, i in words.items() if w in ids or i not in ids.values()}
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    directory = tmp_path_factory.mktemp("named_special_tokens")
    tokenizer.save(str(directory / "tokenizer.json"))
    assert not any(t.special for t in Tokenizer.from_file(str(directory / "tokenizer.json"))
                   .get_added_tokens_decoder().values())
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "</s>",
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "rstrip": False,
                      "normalized": False, "single_word": False},
        "added_tokens_decoder": {str(ids["<pad>"]): {"content": "<pad>", "special": True},
                                 str(ids["<s>"]): {"content": "<s>", "special": False}},
        "unk_token": None,
    }))
    (directory / "special_tokens_map.json").write_text(json.dumps({"additional_special_tokens": ["<extra>"]}))
    llm = LLM.from_model(model, tokenizer=directory, eos_token_id=ids["</s>"], **ENGINE)
    return llm, ids


SPECIAL_PROMPT = [6, 7]
STOP_PROMPT = [12, 2]


def test_tokenizer_config_special_tokens_are_skipped_unless_kept(vocab_llm):
    llm, ids = vocab_llm
    eos, extra, bos, pad = ids["</s>"], ids["<extra>"], ids["<s>"], ids["<pad>"]
    assert llm.decode([bos, 5, extra, pad, eos]) == "w5"
    assert llm.decode([bos, 5, extra, pad, eos], skip_special_tokens=False) == "<s> w5 <extra> <pad> </s>"
    assert llm.encode("w5</s>") == [5, eos]  # a named special token is one token in text, as in transformers

    skip, keep, keep_eos = llm.generate(
        [SPECIAL_PROMPT] * 3,
        [greedy(12), SamplingParams(temperature=0.0, max_tokens=12, skip_special_tokens=False),
         SamplingParams(temperature=0.0, max_tokens=12, skip_special_tokens=False, include_stop_str_in_output=True)],
        use_tqdm=False)
    for out in (skip, keep, keep_eos):
        (seq,) = out.outputs
        assert seq.token_ids[1] == extra and seq.token_ids[3:] == [eos]  # stopped on EOS, which stays an id
        assert (seq.finish_reason, seq.stop_reason) == ("stop", None)
    words = [f"w{skip.outputs[0].token_ids[i]}" for i in (0, 2)]
    assert skip.outputs[0].text == " ".join(words)
    # Kept: <extra>; the EOS that stopped it is text only with include_stop_str_in_output (vLLM's rule).
    assert keep.outputs[0].text == f"{words[0]} <extra> {words[1]}"
    assert keep_eos.outputs[0].text == f"{words[0]} <extra> {words[1]} </s>"


def first_stop(llm, reference, stops):
    """The specification of a stop-string match: the first prefix of ``reference`` whose
    text holds a stop string, and the stop string occurring first in that text:
    (number of tokens, stop string, the prefix's text)."""
    for k in range(1, len(reference) + 1):
        text = llm.decode(reference[:k])
        hits = sorted((text.find(s), i) for i, s in enumerate(stops) if s in text)
        if hits:
            return k, stops[hits[0][1]], text
    raise AssertionError(f"no stop string of {stops} in the reference")


def test_stop_strings_across_token_boundaries(vocab_llm):
    llm, _ = vocab_llm
    unstopped = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    reference = llm.generate([STOP_PROMPT], unstopped, use_tqdm=False)[0].outputs[0].token_ids
    words = [llm.tokenizer.id_to_token(t) for t in reference]

    def across(i: int) -> str:
        """The end of token i's word, the space, the start of token i + 1's."""
        return f"{words[i][-1]} {words[i + 1][:2]}"

    cases = [  # (stops, include_stop_str_in_output, tokens the stop ends at)
        ([across(2)], False, 4),
        ([across(2)], True, 4),
        ([across(5), "zzz", across(1)], False, 3),  # the one first in the text wins
        ([words[0]], False, 1),  # right at the first token
        ([words[0][1:]], True, 1),
    ]
    params = [dataclasses.replace(unstopped, stop=stops, include_stop_str_in_output=include, logprobs=2)
              for stops, include, _ in cases]
    llm.engine.reset_stats()
    outs = llm.generate([STOP_PROMPT] * len(cases), params, use_tqdm=False)
    for (stops, include, num_tokens), out in zip(cases, outs):
        (seq,) = out.outputs
        k, stop, text = first_stop(llm, reference, stops)
        assert k == num_tokens, (stops, k)  # the case is what it says (e.g. the match spans a boundary)
        cut = text.find(stop) + (len(stop) if include else 0)
        assert (seq.text, seq.token_ids) == (text[:cut], reference[:k]), stops
        assert (seq.finish_reason, seq.stop_reason, out.finished) == ("stop", stop, True)
        assert len(seq.logprobs) == k  # the dropped tokens' logprobs too
        assert seq.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(seq.token_ids, seq.logprobs)))
    # Each request ended when its stop was seen: the first token, then at most the decode
    # window that showed the stop and the one already in flight behind it (not 40 tokens).
    window = llm.engine.config.num_scheduler_steps
    assert llm.engine.stats.num_generated_tokens <= len(cases) * (1 + 2 * window) < len(cases) * 40
    assert not llm.engine.scheduler.has_unfinished()  # (a window may still be in flight: never read)


def test_min_tokens_defers_eos_and_stop_strings(vocab_llm):
    """EOS cannot be sampled before ``min_tokens`` tokens (on the device), and a stop
    string counts only where it ends after their text (vLLM's rule)."""
    llm, ids = vocab_llm
    eos = ids["</s>"]
    unstopped = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    reference = llm.generate([STOP_PROMPT], unstopped, use_tqdm=False)[0].outputs[0].token_ids
    stop = llm.tokenizer.id_to_token(reference[0])  # what a plain stop string matches at once
    min_tokens = 3
    protected = len(llm.decode(reference[:min_tokens]))
    expected = next((k for k in range(min_tokens + 1, 41)
                     if llm.decode(reference[:k]).find(stop, protected - len(stop) + 1) >= 0), 40)
    special, stopped = llm.generate(
        [SPECIAL_PROMPT, STOP_PROMPT],
        [SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6),
         dataclasses.replace(unstopped, stop=[stop], min_tokens=min_tokens, include_stop_str_in_output=True)],
        use_tqdm=False)
    (seq,) = special.outputs  # greedy says EOS fourth (`vocab_llm`): held back until 6 tokens
    assert len(seq.token_ids) >= 6 and eos not in seq.token_ids[:6]
    (seq,) = stopped.outputs
    assert expected < 40, "the reference repeats its first word after min_tokens (else pick another case)"
    assert seq.token_ids == reference[:expected] and len(seq.token_ids) > min_tokens
    text = llm.decode(reference[:expected])
    assert (seq.finish_reason, seq.stop_reason) == ("stop", stop)
    assert seq.text == text[:text.find(stop, protected - len(stop) + 1) + len(stop)]


def test_stop_ids_give_the_stop_reason_and_leave_text(vocab_llm):
    llm, _ = vocab_llm
    reference = dense_greedy_generate(llm.model, [STOP_PROMPT], 4)[0]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[reference[2]])
    (engine_out,) = llm.engine.generate([STOP_PROMPT], params, use_tqdm=False)
    (out,) = llm.generate([STOP_PROMPT], params, use_tqdm=False)
    for o in (engine_out, out):  # the engine and LLM return the same shape
        assert type(o) is RequestOutput and o.prompt is None and o.prompt_token_ids == STOP_PROMPT
        (seq,) = o.outputs
        assert (seq.token_ids, seq.finish_reason, seq.stop_reason) == (reference[:3], "stop", reference[2])
    assert engine_out.outputs[0].text is None
    assert out.outputs[0].text == llm.decode(reference[:2])  # the stop token's text is left out


def test_n_samples_per_prompt(vocab_llm):
    llm, _ = vocab_llm
    sampled = SamplingParams(temperature=1.0, max_tokens=6, seed=7, n=3, ignore_eos=True)
    copies, samples = llm.generate(["w6 w7", "w6 w7"], [dataclasses.replace(sampled, temperature=0.0), sampled],
                                   use_tqdm=False)
    for out in (copies, samples):
        assert out.prompt == "w6 w7" and out.finished and [c.index for c in out.outputs] == [0, 1, 2]
        assert all(c.finish_reason == "length" and len(c.token_ids) == 6 for c in out.outputs)
        assert [c.text for c in out.outputs] == [llm.decode(c.token_ids) for c in out.outputs]
    assert len({tuple(c.token_ids) for c in copies.outputs}) == 1  # greedy: identical copies
    assert len({tuple(c.token_ids) for c in samples.outputs}) > 1
    # Sample j draws with seed + j: each is the single request with that seed, so reproducible.
    singles = llm.generate(["w6 w7"] * 3, [dataclasses.replace(sampled, n=1, seed=7 + j) for j in range(3)],
                           use_tqdm=False)
    assert [c.token_ids for c in samples.outputs] == [s.outputs[0].token_ids for s in singles]


def test_stop_strings_and_n_are_refused_where_there_is_no_text(checkpoint):
    _, _, model = checkpoint
    llm = LLM.from_model(model, **ENGINE)  # no tokenizer
    with pytest.raises(ValueError, match=r"sampling_params\[1\]\.stop=\['\.'\]: stop strings need a tokenizer"):
        llm.generate([[1, 2], [3]], [greedy(2), SamplingParams(stop=".")], use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings need text and the engine works on token ids"):
        llm.engine.add_request([1, 2], SamplingParams(stop=["."]))
    with pytest.raises(ValueError, match=r"prompts\[0\]: sampling_params.stop=\['\.'\]: stop strings need text"):
        llm.engine.generate([[1, 2]], SamplingParams(stop="."), use_tqdm=False)
    with pytest.raises(ValueError, match="n=2: add_request adds one sequence"):
        llm.engine.add_request([1, 2], SamplingParams(n=2))
    assert not llm.engine.scheduler.requests  # nothing of the refused requests remains
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        SamplingParams(stop=["a", ""])
    with pytest.raises(TypeError, match="stop must be a str or a sequence of str"):
        SamplingParams(stop=[13])
    with pytest.raises(ValueError, match="n must be >= 1"):
        SamplingParams(n=0)
    with pytest.raises(KeyError, match="unknown request_id 'nope'"):
        llm.engine.stop_request("nope", 1)


def test_special_tokens_the_vocabulary_lacks_are_said_and_bad_configs_named(tmp_path, caplog):
    word_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "<pad>"}))
    caplog.set_level("WARNING", logger="jax_paged_attn")
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.token_to_id("<pad>") is None  # not given a new id the model has no embedding for
    (record,) = caplog.records
    assert "tokenizer_config.json: the special tokens ['<pad>'] are not in" in record.getMessage()
    (tmp_path / "special_tokens_map.json").write_text('{"eos_token": ')
    with pytest.raises(ValueError, match="special_tokens_map.json is not valid JSON"):
        load_tokenizer(tmp_path)
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": 2}))
    with pytest.raises(ValueError, match=r"special_tokens_map.json: eos_token must be a token string or an object"):
        load_tokenizer(tmp_path / "tokenizer.json")
