"""`LLM`: text in, text out over `LLMEngine` (vLLM's ``LLM`` class).

From a Hugging Face checkpoint directory (config.json, *.safetensors and, when it ships
one, tokenizer.json)::

    llm = LLM("/path/to/Llama-3.2-1B", num_blocks=1024)
    outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=16))
    print(outputs[0].outputs[0].text)

Or around a model already built, with token-id prompts when there is no tokenizer::

    llm = LLM.from_model(LlamaForCausalLM(LlamaConfig.tiny(), rngs=nnx.Rngs(0)))
    print(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8))[0].outputs[0].token_ids)

Outputs take vLLM's shape: one `RequestOutput` per prompt (``prompt``,
``prompt_token_ids``), holding one `CompletionOutput` per sampled sequence
(``SamplingParams.n``) with its ``text``, ``token_ids``, ``logprobs``,
``cumulative_logprob``, ``finish_reason`` and ``stop_reason``.

Tokenization uses Hugging Face's ``tokenizers`` library (the Rust tokenizer that
``tokenizer.json`` describes; transformers is not needed): prompts are encoded with the
tokenizer's special tokens (a BOS where its post-processor adds one, as
``AutoTokenizer`` does). The special tokens are those transformers knows: tokenizer.json's
added tokens marked special, and the tokens ``tokenizer_config.json`` and
``special_tokens_map.json`` beside it name (``bos_token``, ``eos_token``, ...,
``additional_special_tokens``, ``added_tokens_decoder`` entries marked special); output
text leaves them out unless ``SamplingParams.skip_special_tokens`` is False.

The engine decides when a request ends by tokens (``max_tokens``, the stop ids, the
end-of-sequence id); stop strings (``SamplingParams.stop``) need text, so `LLM` checks
them on the host after every engine step, decoding each sequence's new tokens, and ends
a sequence whose text holds one (`LLMEngine.generate`'s ``stop_checker``). `LLM` uses
only the engine's public API.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import TYPE_CHECKING, Any, Sequence

import jax
import numpy as np
from flax import nnx

from jax_paged_attn.engine.config import EngineConfig
from jax_paged_attn.engine.engine import LLMEngine
from jax_paged_attn.engine.outputs import CompletionOutput, RequestOutput
from jax_paged_attn.engine.sampling import Logprob, SamplingParams, params_per_prompt

if TYPE_CHECKING:
    from tokenizers import AddedToken, Tokenizer

TOKENIZER_FILE = "tokenizer.json"
SPECIAL_TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")
"""Files beside tokenizer.json that name special tokens (transformers reads both)."""
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

logger = logging.getLogger(__name__)


def load_tokenizer(path: str | os.PathLike) -> "Tokenizer":
    """A `tokenizers.Tokenizer` from a ``tokenizer.json`` file or a directory holding one,
    with the special tokens the ``tokenizer_config.json`` and ``special_tokens_map.json``
    beside it name registered as special (as transformers does), so decoding can skip
    them. A named token the vocabulary lacks is left out (said once in a warning):
    transformers would give it a new id, which the model has no embedding for."""
    from tokenizers import Tokenizer

    path = os.fspath(path)
    file = os.path.join(path, TOKENIZER_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no tokenizer file {file!r} (a Hugging Face {TOKENIZER_FILE}).")
    try:
        tokenizer = Tokenizer.from_file(file)
    except Exception as e:  # the Rust library raises its own Exception type for bad files
        raise ValueError(f"{file} is not a tokenizers tokenizer.json: {e}") from e
    directory = os.path.dirname(file)
    already_special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    named = [t for t in _config_special_tokens(directory) if t.content not in already_special]
    unknown = [t.content for t in named if tokenizer.token_to_id(t.content) is None]
    if unknown:
        logger.warning("%s: the special tokens %s are not in %s's vocabulary; left out (no id to give them).",
                       " / ".join(f for f in SPECIAL_TOKEN_FILES if os.path.isfile(os.path.join(directory, f))),
                       unknown, file)
    tokenizer.add_special_tokens([t for t in named if t.content not in unknown])
    return tokenizer


def _config_special_tokens(directory: str) -> "list[AddedToken]":
    """The special tokens ``tokenizer_config.json`` and ``special_tokens_map.json`` in
    ``directory`` name (those files that exist), first mention first."""
    found: dict[str, AddedToken] = {}
    for name in SPECIAL_TOKEN_FILES:
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            continue
        try:
            with open(file, encoding="utf-8") as f:
                config = json.load(f)
        except ValueError as e:
            raise ValueError(f"{file} is not valid JSON: {e}") from e
        if not isinstance(config, dict):
            raise ValueError(f"{file} must hold a JSON object, got {type(config).__name__}.")
        entries = [(key, config.get(key)) for key in NAMED_SPECIAL_TOKENS]
        additional = config.get("additional_special_tokens") or []
        if not isinstance(additional, list):
            raise ValueError(f"{file}: additional_special_tokens must be a list, got {additional!r}.")
        entries += [(f"additional_special_tokens[{i}]", v) for i, v in enumerate(additional)]
        decoder = config.get("added_tokens_decoder") or {}
        if not isinstance(decoder, dict):
            raise ValueError(f"{file}: added_tokens_decoder must be an object, got {decoder!r}.")
        entries += [(f"added_tokens_decoder[{k!r}]", v) for k, v in decoder.items()
                    if not isinstance(v, dict) or v.get("special")]
        for key, value in entries:
            token = _special_token(value, f"{file}: {key}")
            if token is not None:
                found.setdefault(token.content, token)
    return list(found.values())


def _special_token(value: Any, where: str) -> "AddedToken | None":
    """A special `AddedToken` from a config entry: a string, or an AddedToken object
    (``{"content": ..., "lstrip": ..., ...}``, as transformers saves them); None: unset."""
    from tokenizers import AddedToken

    if value is None:
        return None
    if isinstance(value, str):
        return AddedToken(value, special=True, normalized=False)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        options = {k: bool(value[k]) for k in ("single_word", "lstrip", "rstrip", "normalized") if k in value}
        return AddedToken(value["content"], special=True, **{"normalized": False, **options})
    raise ValueError(f"{where} must be a token string or an object with a 'content' string, got {value!r}.")


def _engine_config(engine_options: dict[str, Any]) -> EngineConfig:
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(engine_options) - fields)
    if unknown:
        raise TypeError(f"unknown engine option(s) {unknown}; the EngineConfig fields are {sorted(fields)}.")
    return EngineConfig(**engine_options)


def _as_tokenizer(tokenizer: Any) -> "Tokenizer | None":
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        return None if tokenizer is None else load_tokenizer(tokenizer)
    from tokenizers import Tokenizer

    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(
            f"tokenizer must be None, a path to a {TOKENIZER_FILE} (or its directory) or a tokenizers.Tokenizer, "
            f"got {type(tokenizer).__name__}.")
    return tokenizer


class LLM:
    """A model, its tokenizer and an `LLMEngine`: generate from text or token-id prompts.

    Args:
      model: a Hugging Face checkpoint directory (vLLM's argument name; its older name
        here, ``checkpoint_dir``, is taken too), loaded with
        `jax_paged_attn.models.load_llama`.
      dtype: compute dtype, or "auto": the dtype the checkpoint names.
      kv_cache_dtype: "auto" (the compute dtype), "fp8" / "fp8_e4m3" or "fp8_e5m2".
      implementation: attention implementation: None / "auto", "xla" or "triton".
      interpret: run the Pallas kernels in interpret mode (CPU).
      tensor_parallel_size: devices the model is split over by attention heads (vLLM's
        name): 1 runs on the default device; N > 1 builds a mesh of the first N devices
        (`jax_paged_attn.parallel.tensor_parallel_mesh`) and loads each device's shards
        of the checkpoint straight onto it, for a model one device cannot hold.
      tokenizer: "auto" (the checkpoint's tokenizer.json when it has one, else none,
        said in a warning), None (token ids only), a path to a tokenizer.json or its
        directory (both read with the special tokens the tokenizer_config.json /
        special_tokens_map.json beside it name: `load_tokenizer`), or a
        `tokenizers.Tokenizer` (used as it is).
      warmup: compile every program of the engine now (`LLMEngine.warmup`), so that no
        `generate` stalls on a compilation; None: on accelerators, not on the CPU
        backend (where compiling every shape takes longer than most CPU runs need;
        programs then compile on first use), said once in the log.
      engine_options: fields of `EngineConfig` (``num_blocks``, ``block_size``,
        ``max_num_seqs``, ...); an unknown name raises TypeError.

    `from_model` wraps a model already built. Attributes: ``model``, ``tokenizer``
    (None without one), ``engine``.
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        checkpoint_dir: str | os.PathLike | None = None,
        dtype: Any = "auto",
        kv_cache_dtype: str = "auto",
        implementation: str | None = None,
        interpret: bool = False,
        tensor_parallel_size: int = 1,
        tokenizer: "str | os.PathLike | Tokenizer | None" = "auto",
        warmup: bool | None = None,
        **engine_options: Any,
    ) -> None:
        # The front end loads checkpoints; the engine itself never imports a model.
        from jax_paged_attn.models import load_llama
        from jax_paged_attn.models.checkpoint import read_hf_config

        if (model is None) == (checkpoint_dir is None):
            raise TypeError("LLM takes the checkpoint directory once: LLM(model=PATH) (or LLM(PATH)); got "
                            + ("neither model nor checkpoint_dir." if model is None else "both model and checkpoint_dir."))
        if model is None:
            model = checkpoint_dir
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model must be a checkpoint directory (a str or os.PathLike), got {type(model).__name__}; "
                            f"for a model already built use LLM.from_model(model).")
        config = _engine_config(engine_options)  # bad options fail before the weights load
        mesh = None
        if tensor_parallel_size != 1:
            from jax_paged_attn import parallel

            mesh = parallel.tensor_parallel_mesh(tensor_parallel_size)  # ValueError naming tensor_parallel_size
        checkpoint_dir = os.path.expanduser(os.fspath(model))
        read_hf_config(checkpoint_dir)  # a missing directory or config.json is said first, and alone
        if isinstance(tokenizer, str) and tokenizer == "auto":
            if os.path.isfile(os.path.join(checkpoint_dir, TOKENIZER_FILE)):
                tokenizer = checkpoint_dir
            else:
                tokenizer = None
                logger.warning("no %s in %s: prompts must be token ids and outputs carry no text "
                               "(pass tokenizer= to use one from elsewhere).", TOKENIZER_FILE, checkpoint_dir)
        tokenizer = _as_tokenizer(tokenizer)
        loaded = load_llama(checkpoint_dir, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                            implementation=implementation, interpret=interpret, mesh=mesh)
        self._setup(loaded, tokenizer, config, warmup)

    @classmethod
    def from_model(
        cls,
        model: nnx.Module,
        tokenizer: "str | os.PathLike | Tokenizer | None" = None,
        warmup: bool | None = None,
        **engine_options: Any,
    ) -> "LLM":
        """An `LLM` over ``model`` (a `LlamaForCausalLM`, or any model `LLMEngine` runs).

        ``tokenizer``: None (token-id prompts only), a path to a tokenizer.json or its
        directory, or a `tokenizers.Tokenizer`. ``warmup``: as `LLM`'s.
        ``engine_options``: `EngineConfig` fields.
        """
        llm = cls.__new__(cls)
        llm._setup(model, _as_tokenizer(tokenizer), _engine_config(engine_options), warmup)
        return llm

    def _setup(self, model: nnx.Module, tokenizer: "Tokenizer | None", config: EngineConfig,
               warmup: bool | None) -> None:
        if warmup is not None and not isinstance(warmup, bool):
            raise TypeError(f"warmup must be a bool or None, got {warmup!r}.")
        self.model = model
        self.tokenizer = tokenizer
        self.engine = LLMEngine(model, config)
        if warmup is None:
            warmup = jax.default_backend() != "cpu"
            if not warmup:
                logger.info("LLM: no warm-up on the cpu backend (compiling every program shape takes longer "
                            "there than most CPU runs need); programs compile on first use. Pass warmup=True "
                            "to compile them at start.")
        if warmup:
            self.engine.warmup()

    # ------------------------------------------------------------ tokens <-> text
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's special tokens, e.g. a BOS)."""
        return list(self._require_tokenizer("encode").encode(text).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; special tokens (BOS, EOS, those the tokenizer's configs
        name, ...) skipped unless ``skip_special_tokens`` is False."""
        return self._require_tokenizer("decode").decode([int(t) for t in token_ids],
                                                        skip_special_tokens=skip_special_tokens)

    def _require_tokenizer(self, what: str) -> "Tokenizer":
        if self.tokenizer is None:
            raise ValueError(f"cannot {what} text: this LLM has no tokenizer (pass tokenizer= or use token ids).")
        return self.tokenizer

    def _decoded_logprobs(self, logprobs: list[dict[int, Logprob]] | None, token_text: dict[int, str]
                          ) -> list[dict[int, Logprob]] | None:
        """``logprobs`` with each ``decoded_token`` set to its token's text (special tokens
        included, as vLLM shows them), or as they are without a tokenizer."""
        if logprobs is None or self.tokenizer is None:
            return logprobs

        def text(token: int) -> str:
            if token not in token_text:
                token_text[token] = self.tokenizer.decode([token], skip_special_tokens=False)
            return token_text[token]

        return [{t: dataclasses.replace(lp, decoded_token=text(t)) for t, lp in entry.items()} for entry in logprobs]

    def _text_of(self, completion: CompletionOutput, params: SamplingParams, num_tokens: int | None = None) -> str:
        """The text of a sequence's first ``num_tokens`` tokens (all by default), before
        any stop-string cut: without the text of a stop token that ended it (EOS or a
        stop id) unless ``include_stop_str_in_output`` (vLLM's rule)."""
        ids = completion.token_ids[:num_tokens]
        stopped_by_token = completion.finish_reason == "stop" and not isinstance(completion.stop_reason, str)
        if stopped_by_token and len(ids) == len(completion.token_ids) and not params.include_stop_str_in_output:
            ids = ids[:-1]
        return self.decode(ids, skip_special_tokens=params.skip_special_tokens)

    def _completion_text(self, completion: CompletionOutput, params: SamplingParams) -> str:
        """The sequence's output text: cut before its stop string (after it with
        ``include_stop_str_in_output``)."""
        text = self._text_of(completion, params)
        stop = completion.stop_reason
        if isinstance(stop, str):
            cut = text.find(stop, stop_search_start(stop, self._protected_length(completion, params)))
            assert cut >= 0, "a sequence stopped by a string keeps the tokens that hold it"
            text = text[:cut + len(stop)] if params.include_stop_str_in_output else text[:cut]
        return text

    def _protected_length(self, completion: CompletionOutput, params: SamplingParams) -> int:
        """Characters of the text of the first ``min_tokens`` tokens, where no stop string
        may end (vLLM looks for stop strings only in the text of later tokens)."""
        return len(self._text_of(completion, params, params.min_tokens)) if params.min_tokens else 0

    # ------------------------------------------------------------ generate
    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates for every prompt; outputs come back in prompt order.

        Args:
          prompts: one prompt or a list of them (vLLM's forms): a text (needs a
            tokenizer), token ids (a list of ints or a 1-D integer NumPy / JAX array), or
            a dict with ``"prompt"`` (text) or ``"prompt_token_ids"`` and optionally
            ``"cache_salt"`` (`SamplingParams.cache_salt` for that prompt); the kinds may
            be mixed. One prompt returns a list of one output.
          sampling_params: one `SamplingParams` for all prompts or one per prompt (None:
            vLLM's defaults).
          use_tqdm: show progress.

        Returns one `RequestOutput` per prompt (vLLM's shape): ``prompt`` (None for a
        token-id prompt), ``prompt_token_ids`` and ``outputs``, one `CompletionOutput`
        per sequence (``SamplingParams.n``): ``text`` (None without a tokenizer),
        ``token_ids``, ``logprobs`` (each ``decoded_token`` the token's text),
        ``cumulative_logprob``, ``finish_reason``, ``stop_reason``.

        Stop strings (``SamplingParams.stop``) are looked for in each sequence's text
        after every engine step (so across token boundaries); the first token whose text
        completes one ends the sequence there: no later token is generated for it (the
        engine may already have computed a few, in the decode windows in flight) or
        returned.

        Raises:
          TypeError / ValueError naming ``prompts[i]`` for a bad prompt (text without a
          tokenizer, ids out of the vocabulary, ...) or ``sampling_params`` (stop strings
          without a tokenizer); nothing runs then.
        """
        prompts = _as_prompt_list(prompts)
        params_list = params_per_prompt(sampling_params, len(prompts))
        token_ids: list[Any] = []
        texts: list[str | None] = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, dict):
                prompt, salt = _dict_prompt(prompt, f"prompts[{i}]")
                if salt is not None:
                    params_list[i] = dataclasses.replace(params_list[i], cache_salt=salt)
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError(f"prompts[{i}] is text, but this LLM has no tokenizer; pass token ids or "
                                     f"give it a tokenizer ({TOKENIZER_FILE}).")
                if not prompt:
                    raise ValueError(f"prompts[{i}] is an empty text; a prompt needs at least one token.")
                token_ids.append(self.encode(prompt))
                texts.append(prompt)
            elif _is_token_prompt(prompt):
                token_ids.append(prompt)  # checked by the engine (`validate_prompt`), errors naming prompts[i]
                texts.append(None)
            else:
                raise TypeError(f"prompts[{i}] must be a text, a list or 1-D integer array of token ids, or a dict "
                                f"with 'prompt' or 'prompt_token_ids', got {type(prompt).__name__}.")
        if self.tokenizer is None:
            for i, params in enumerate(params_list):
                if params.stop:
                    where = "sampling_params" if isinstance(sampling_params, SamplingParams) else f"sampling_params[{i}]"
                    raise ValueError(f"{where}.stop={list(params.stop)!r}: stop strings need a tokenizer and this "
                                     f"LLM has none (pass tokenizer=, or use stop_token_ids).")
        checker = _StopStrings(self, params_list) if any(p.stop for p in params_list) else None
        results = self.engine.generate(token_ids, params_list, use_tqdm=use_tqdm, stop_checker=checker)
        if self.tokenizer is None:
            return results
        token_text: dict[int, str] = {}  # each distinct id decoded once per call
        return [
            dataclasses.replace(out, prompt=text, outputs=[
                dataclasses.replace(c, text=self._completion_text(c, params),
                                    logprobs=self._decoded_logprobs(c.logprobs, token_text))
                for c in out.outputs])
            for text, params, out in zip(texts, params_list, results)
        ]


_DICT_PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


def _is_token_prompt(value: Any) -> bool:
    """Whether ``value`` has the form of one token-id prompt: a list / tuple, or an
    array (NumPy's, JAX's) of one dimension."""
    if isinstance(value, (list, tuple)):
        return True
    return hasattr(value, "__array__") and np.ndim(value) == 1


def _as_prompt_list(prompts: Any) -> list[Any]:
    """`LLM.generate`'s prompts as a list: one prompt (a text, a dict, a flat list or a
    1-D array of token ids) becomes a list of one."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if hasattr(prompts, "__array__") and not isinstance(prompts, (list, tuple)):
        if np.ndim(prompts) != 1:
            raise TypeError(f"prompts as an array must be one prompt's token ids (1-D), got {np.ndim(prompts)}-D; "
                            f"pass a list of prompts.")
        return [prompts]
    if isinstance(prompts, bytes) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a text, token ids, a dict prompt or a list of them, got "
                        f"{type(prompts).__name__}.")
    if prompts and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt's token ids (vLLM reads a flat list of ints so)
    return list(prompts)


def _dict_prompt(prompt: dict, where: str) -> tuple[Any, str | None]:
    """``(text or token ids, cache_salt)`` of vLLM's dict prompt (``TextPrompt`` /
    ``TokensPrompt``)."""
    unknown = sorted(set(prompt) - set(_DICT_PROMPT_KEYS))
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {unknown}; a dict prompt takes {list(_DICT_PROMPT_KEYS)}.")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError(f"{where} must hold exactly one of 'prompt' (text) and 'prompt_token_ids'.")
    if "prompt" in prompt and not isinstance(prompt["prompt"], str):
        raise TypeError(f"{where}['prompt'] must be a str, got {type(prompt['prompt']).__name__}.")
    salt = prompt.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise TypeError(f"{where}['cache_salt'] must be a str, got {type(salt).__name__}.")
    return prompt.get("prompt", prompt.get("prompt_token_ids")), salt


class _StopStrings:
    """`LLMEngine.generate`'s ``stop_checker`` for one `LLM.generate` call: finds the
    first token whose text completes one of the prompt's stop strings.

    Each check decodes the sequence's tokens once (a sequence gains a token per step or
    a decode window's tokens at once); only when the text holds a stop string are the
    new tokens' prefixes decoded one by one, to find the token that completed it.
    """

    def __init__(self, llm: LLM, params: list[SamplingParams]) -> None:
        self.llm = llm
        self.params = params
        self.num_clean: dict[tuple[int, int], int] = {}  # tokens whose text holds no stop string
        self.protected: dict[tuple[int, int], int] = {}  # text length of a sequence's first min_tokens tokens

    def __call__(self, prompt_index: int, sample_index: int, completion: CompletionOutput) -> tuple[int, str] | None:
        params = self.params[prompt_index]
        if not params.stop or len(completion.token_ids) <= params.min_tokens:
            return None
        key = (prompt_index, sample_index)
        protected = self.protected.get(key)
        if protected is None:  # fixed once the sequence is past min_tokens: decoded once
            protected = self.protected[key] = self.llm._protected_length(completion, params)
        if first_stop(self.llm._text_of(completion, params), params.stop, protected) is None:
            self.num_clean[key] = len(completion.token_ids)
            return None
        start = max(self.num_clean.get(key, 0), params.min_tokens)
        for num_tokens in range(start + 1, len(completion.token_ids) + 1):
            found = first_stop(self.llm._text_of(completion, params, num_tokens), params.stop, protected)
            if found is not None:
                return num_tokens, found[1]
        raise AssertionError("the whole text holds a stop string, so some prefix does")


def stop_search_start(stop: str, protected: int) -> int:
    """Where to look for ``stop`` in a text whose first ``protected`` characters are the
    first ``min_tokens`` tokens': a match must end after them."""
    return max(0, protected - len(stop) + 1)


def first_stop(text: str, stops: Sequence[str], protected: int = 0) -> tuple[int, str] | None:
    """``(position, stop string)`` of the stop string that occurs first in ``text`` (at
    equal positions, the first listed) and ends after its first ``protected``
    characters (the text of the first ``min_tokens`` tokens, where vLLM looks for none),
    or None."""
    found = [(text.find(stop, stop_search_start(stop, protected)), i) for i, stop in enumerate(stops)]
    found = [f for f in found if f[0] >= 0]
    if not found:
        return None
    position, i = min(found)
    return position, stops[i]
