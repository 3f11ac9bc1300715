"""`LLM`: text in, text out over `LLMEngine` (vLLM's ``LLM`` class).

From a Hugging Face checkpoint directory (config.json, *.safetensors and, when it ships
one, tokenizer.json)::

    llm = LLM("/path/to/Llama-3.2-1B", num_blocks=1024)
    outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=16))
    print(outputs[0].text)

Or around a model already built, with token-id prompts when there is no tokenizer::

    llm = LLM.from_model(LlamaForCausalLM(LlamaConfig.tiny(), rngs=nnx.Rngs(0)))
    print(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8))[0].output_token_ids)

Tokenization uses Hugging Face's ``tokenizers`` library (the Rust tokenizer that
``tokenizer.json`` describes; transformers is not needed): prompts are encoded with the
tokenizer's special tokens (a BOS where its post-processor adds one, as
``AutoTokenizer`` does) and outputs decoded without them. `LLM` uses only the engine's
public API (`LLMEngine`, `EngineConfig`, `LLMEngine.generate`); the engine decides when a
request ends (``max_tokens``, the stop ids, the end-of-sequence id).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
from flax import nnx

from jax_paged_attn.engine.engine import EngineConfig, LLMEngine, RequestOutput
from jax_paged_attn.engine.sampling import Logprob, SamplingParams

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LLMOutput:
    """One finished prompt of `LLM.generate`.

    Attributes:
      request_id: the engine's id of the request.
      prompt: the prompt text, or None for a token-id prompt.
      prompt_token_ids: the prompt as token ids (the tokenizer's encoding of ``prompt``).
      text: the generated tokens decoded (special tokens skipped), or None without a
        tokenizer.
      output_token_ids: the generated token ids (an end-of-sequence id included).
      finish_reason: "length", "stop", "max_model_len" or "aborted" (`RequestOutput`).
      request_output: the engine's `RequestOutput` (timings, preemptions, cached tokens).
      logprobs: with ``SamplingParams.logprobs``: one ``{token_id: Logprob}`` per output
        token (`RequestOutput.logprobs`), each ``decoded_token`` the token's text when
        there is a tokenizer; else None.
      cumulative_logprob: the sum of the output tokens' logprobs, or None.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str | None
    output_token_ids: list[int]
    finish_reason: str
    request_output: RequestOutput
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None


def load_tokenizer(path: str | os.PathLike) -> "Tokenizer":
    """A `tokenizers.Tokenizer` from a ``tokenizer.json`` file or a directory holding one."""
    from tokenizers import Tokenizer

    path = os.fspath(path)
    file = os.path.join(path, TOKENIZER_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no tokenizer file {file!r} (a Hugging Face {TOKENIZER_FILE}).")
    try:
        return Tokenizer.from_file(file)
    except Exception as e:  # the Rust library raises its own Exception type for bad files
        raise ValueError(f"{file} is not a tokenizers tokenizer.json: {e}") from e


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
      checkpoint_dir: a Hugging Face checkpoint directory, loaded with
        `jax_paged_attn.models.load_llama`.
      dtype: compute dtype, or "auto": the dtype the checkpoint names.
      kv_cache_dtype: "auto" (the compute dtype), "fp8" / "fp8_e4m3" or "fp8_e5m2".
      implementation: attention implementation: None / "auto", "xla" or "triton".
      interpret: run the Pallas kernels in interpret mode (CPU).
      tokenizer: "auto" (the checkpoint's tokenizer.json when it has one, else none,
        said in a warning), None (token ids only), a path to a tokenizer.json or its
        directory, or a `tokenizers.Tokenizer`.
      engine_options: fields of `EngineConfig` (``num_blocks``, ``block_size``,
        ``max_num_seqs``, ...); an unknown name raises TypeError.

    `from_model` wraps a model already built. Attributes: ``model``, ``tokenizer``
    (None without one), ``engine``.
    """

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike,
        *,
        dtype: Any = "auto",
        kv_cache_dtype: str = "auto",
        implementation: str | None = None,
        interpret: bool = False,
        tokenizer: "str | os.PathLike | Tokenizer | None" = "auto",
        **engine_options: Any,
    ) -> None:
        # The front end loads checkpoints; the engine itself never imports a model.
        from jax_paged_attn.models import load_llama
        from jax_paged_attn.models.checkpoint import read_hf_config

        config = _engine_config(engine_options)  # bad options fail before the weights load
        checkpoint_dir = os.fspath(checkpoint_dir)
        read_hf_config(checkpoint_dir)  # a missing directory or config.json is said first, and alone
        if isinstance(tokenizer, str) and tokenizer == "auto":
            if os.path.isfile(os.path.join(checkpoint_dir, TOKENIZER_FILE)):
                tokenizer = checkpoint_dir
            else:
                tokenizer = None
                logger.warning("no %s in %s: prompts must be token ids and outputs carry no text "
                               "(pass tokenizer= to use one from elsewhere).", TOKENIZER_FILE, checkpoint_dir)
        tokenizer = _as_tokenizer(tokenizer)
        model = load_llama(checkpoint_dir, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                           implementation=implementation, interpret=interpret)
        self._setup(model, tokenizer, config)

    @classmethod
    def from_model(
        cls,
        model: nnx.Module,
        tokenizer: "str | os.PathLike | Tokenizer | None" = None,
        **engine_options: Any,
    ) -> "LLM":
        """An `LLM` over ``model`` (a `LlamaForCausalLM`, or any model `LLMEngine` runs).

        ``tokenizer``: None (token-id prompts only), a path to a tokenizer.json or its
        directory, or a `tokenizers.Tokenizer`. ``engine_options``: `EngineConfig` fields.
        """
        llm = cls.__new__(cls)
        llm._setup(model, _as_tokenizer(tokenizer), _engine_config(engine_options))
        return llm

    def _setup(self, model: nnx.Module, tokenizer: "Tokenizer | None", config: EngineConfig) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.engine = LLMEngine(model, config)

    # ------------------------------------------------------------ tokens <-> text
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's special tokens, e.g. a BOS)."""
        return list(self._require_tokenizer("encode").encode(text).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, special tokens (BOS, EOS, ...) skipped."""
        return self._require_tokenizer("decode").decode([int(t) for t in token_ids], skip_special_tokens=True)

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

    # ------------------------------------------------------------ generate
    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[LLMOutput]:
        """Generates for every prompt; outputs come back in prompt order.

        Args:
          prompts: a list whose entries are each a text (needs a tokenizer) or a list of
            token ids; both kinds may be mixed.
          sampling_params: one `SamplingParams` for all prompts or one per prompt (None:
            the engine's default).
          use_tqdm: show progress.

        Raises:
          TypeError / ValueError naming ``prompts[i]`` for a bad prompt (text without a
          tokenizer, ids out of the vocabulary, ...); nothing runs then.
        """
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a list of texts or of token-id lists, got {type(prompts).__name__} "
                            f"(for one prompt pass [prompt]).")
        token_ids: list[list[int]] = []
        texts: list[str | None] = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError(f"prompts[{i}] is text, but this LLM has no tokenizer; pass token ids or "
                                     f"give it a tokenizer ({TOKENIZER_FILE}).")
                token_ids.append(self.encode(prompt))
                texts.append(prompt)
            elif isinstance(prompt, (Sequence, np.ndarray)) and not isinstance(prompt, bytes):
                token_ids.append(list(prompt))
                texts.append(None)
            else:
                raise TypeError(f"prompts[{i}] must be a text or a list of token ids, got {type(prompt).__name__}.")
        results = self.engine.generate(token_ids, sampling_params, use_tqdm=use_tqdm)
        token_text: dict[int, str] = {}  # each distinct id decoded once per call
        return [
            LLMOutput(
                request_id=out.request_id,
                prompt=text,
                prompt_token_ids=list(out.prompt_token_ids),
                text=None if self.tokenizer is None else self.decode(out.output_token_ids),
                output_token_ids=list(out.output_token_ids),
                finish_reason=out.finish_reason,
                request_output=out,
                logprobs=self._decoded_logprobs(out.logprobs, token_text),
                cumulative_logprob=out.cumulative_logprob,
            )
            for text, out in zip(texts, results)
        ]
