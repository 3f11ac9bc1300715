"""Per-request sampling parameters and the jit-able batched sampler.

`SamplingParams` is what a user passes with each request (vLLM's names). It is
validated on construction, so a bad request fails in ``add_request`` and never reaches
a batch. `sample_tokens` runs inside the engine's jitted step: one row of logits per
sequence, each row with its own temperature / top-p / top-k / min-p and its own PRNG
stream. The penalties, ``logit_bias`` and ``min_tokens`` change the logits before it
(`jax_paged_attn.engine.penalties`).

Randomness: request r draws its t-th token with
``fold_in(PRNGKey(seed_r), t)``, so a seeded request produces the same tokens whatever
else shares its batch and whatever step it runs in.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

TOP_K_DISABLED = -1
"""``top_k`` value that keeps the whole vocabulary (vLLM's -1; 0 is accepted too)."""

MAX_LOGPROBS = 20
"""Largest ``SamplingParams.logprobs`` (vLLM's default ``max_logprobs``)."""

MAX_LOGIT_BIAS = 300
"""Most ``SamplingParams.logit_bias`` entries of a request (OpenAI's limit): the device
holds every row's biases in this many padded columns, so no request compiles a program."""

MAX_PENALTY = 2.0
"""``presence_penalty`` and ``frequency_penalty`` lie in ``[-MAX_PENALTY, MAX_PENALTY]`` (vLLM's and OpenAI's range)."""


@dataclasses.dataclass(frozen=True)
class Logprob:
    """The log probability of one token at one output position (vLLM's ``Logprob``).

    Attributes:
      logprob: ``log_softmax`` of the model's raw logits at that position (float32,
        before temperature / top-p / top-k; see `SamplingParams.logprobs`).
      rank: 1-based rank of the token in the vocabulary by probability: 1 + the number
        of tokens with a strictly greater logprob (tied tokens share a rank).
      decoded_token: the token's text; filled by `jax_paged_attn.engine.LLM` when it has
        a tokenizer, else None.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request.

    Attributes:
      temperature: 0 means greedy (argmax); > 0 divides the logits before sampling.
      top_p: nucleus sampling; keeps the smallest set of most likely tokens whose
        probability reaches ``top_p``. In (0, 1]; 1 keeps everything.
      top_k: keeps the ``top_k`` most likely tokens; -1 (or 0) keeps everything.
      max_tokens: number of tokens to generate at most (>= 1).
      seed: PRNG seed of this request; None lets the engine pick one (its own seed
        plus the request's arrival number, so runs are reproducible).
      stop_token_ids: generation stops after producing any of these (it is kept in
        the output).
      ignore_eos: keep generating after the engine's ``eos_token_id``.
      logprobs: None (default) returns no log probabilities. An int ``k`` in
        ``[0, MAX_LOGPROBS]`` makes the output carry, for every generated token, a dict
        ``{token_id: Logprob}`` holding the ``k`` most likely tokens and the sampled one
        (``k`` or ``k + 1`` entries; ``k = 0``: the sampled token only), and the sum of
        the sampled tokens' logprobs (``cumulative_logprob``). The logprobs are those of
        the model's own distribution, ``log_softmax`` of the raw float32 logits, before
        temperature, top-p and top-k (what vLLM V1 returns by default, its
        "raw_logprobs"; vLLM 0.6 returned the processed distribution's).
      n: sequences to sample from the prompt (>= 1), each its own completion
        (`CompletionOutput.index`). Sample ``j`` of a seeded request draws with seed
        ``seed + j`` (vLLM's rule), so the samples differ and each is reproducible;
        unseeded samples get distinct seeds from the engine. Greedy samples are
        identical copies. `LLMEngine.generate` and `LLM.generate` take ``n``;
        `LLMEngine.add_request` adds one sequence.
      stop: a string or strings that end the generation when the output text contains
        one (a match may span tokens; the earliest match in the text wins). The text
        ends before the stop string, the token ids with the token that completed it
        (later ones are dropped), ``finish_reason`` is "stop" and ``stop_reason`` the
        string. Needs text: `LLM` with a tokenizer (the bare engine refuses it).
      include_stop_str_in_output: keep the matched stop string at the end of the text;
        and keep a stop token's text (EOS, ``stop_token_ids``), which is otherwise left
        out of the text (vLLM's rule; the id stays in the token ids).
      skip_special_tokens: leave the tokenizer's special tokens (BOS, EOS, those its
        tokenizer_config.json names, ...) out of the text (default); False keeps them.
        Text options (``stop``, ``include_stop_str_in_output``, ``skip_special_tokens``)
        act in `LLM`; the engine itself returns token ids only.
      cache_salt: scopes this request's prefix-cache hits (vLLM's ``cache_salt``): a
        request reuses cached blocks only of requests with the same salt (None: the
        shared, unsalted cache). A server holding several tenants gives each its own
        salt, so that no tenant can tell from its requests' speed or
        ``num_cached_tokens`` which prompts another tenant sent.
      presence_penalty: in [-2, 2]; subtracted from the logit of every token the output
        holds so far (vLLM's and OpenAI's definition; the prompt does not count). > 0
        favours new tokens.
      frequency_penalty: in [-2, 2]; subtracted from a token's logit once per time the
        output holds it so far.
      repetition_penalty: > 0; every token of the prompt or the output so far has its
        logit divided by it when positive and multiplied by it otherwise (vLLM's, after
        CTRL); > 1 discourages repetition, 1 is off.
      min_p: in [0, 1]; keeps only the tokens whose probability (after temperature) is at
        least ``min_p`` times the most likely token's. 0 is off; no effect on greedy rows.
      min_tokens: the stop ids (EOS unless ``ignore_eos``, and ``stop_token_ids``) cannot
        be sampled before the output holds this many tokens; <= ``max_tokens``.
      logit_bias: ``{token_id: bias}``, at most `MAX_LOGIT_BIAS` entries; each bias is
        added to its token's logit (before the penalties, as vLLM does). The engine
        checks the ids against its vocabulary (`LLMEngine.add_request`).

    The logits pass, in vLLM V1's order: ``logit_bias``, ``min_tokens``, the repetition,
    frequency and presence penalties; then greedy rows take the argmax, and other rows
    divide by the temperature, apply ``min_p``, top-k and top-p, and sample. Log
    probabilities stay those of the raw logits (see ``logprobs``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_DISABLED
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    stop: str | Sequence[str] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        temperature = _as_float(self.temperature, "temperature")
        if not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}.")
        top_p = _as_float(self.top_p, "top_p")
        if not (0.0 < top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}.")
        top_k = _as_int(self.top_k, "top_k")
        if top_k < TOP_K_DISABLED:
            raise ValueError(f"top_k must be >= 1, or -1 / 0 to disable it, got {self.top_k!r}.")
        max_tokens = _as_int(self.max_tokens, "max_tokens")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}.")
        seed = None if self.seed is None else _as_int(self.seed, "seed")
        if seed is not None and not 0 <= seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed!r}.")
        try:
            stop_ids = tuple(_as_int(t, "stop_token_ids") for t in self.stop_token_ids)
        except TypeError as e:
            raise TypeError(f"stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}.") from e
        logprobs = None if self.logprobs is None else _as_int(self.logprobs, "logprobs")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}.")
        n = _as_int(self.n, "n")
        if n < 1:
            raise ValueError(f"n must be >= 1 (sequences per prompt), got {self.n!r}.")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
            raise TypeError(f"stop must be a str or a sequence of str, got {self.stop!r}.")
        if any(not s for s in stop):
            raise ValueError(f"stop strings must not be empty, got {self.stop!r}.")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise TypeError(f"cache_salt must be None or a str, got {type(self.cache_salt).__name__}.")
        if self.cache_salt == "":
            raise ValueError("cache_salt must not be empty (None shares the unsalted prefix cache).")
        self._check_logits_processing(max_tokens)
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "top_k", TOP_K_DISABLED if top_k == 0 else top_k)
        object.__setattr__(self, "max_tokens", max_tokens)
        object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "stop_token_ids", stop_ids)
        object.__setattr__(self, "ignore_eos", as_bool(self.ignore_eos, "ignore_eos"))
        object.__setattr__(self, "logprobs", logprobs)
        object.__setattr__(self, "n", n)
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "include_stop_str_in_output",
                           as_bool(self.include_stop_str_in_output, "include_stop_str_in_output"))
        object.__setattr__(self, "skip_special_tokens", as_bool(self.skip_special_tokens, "skip_special_tokens"))

    def _check_logits_processing(self, max_tokens: int) -> None:
        """Validates and normalizes the penalties, ``min_p``, ``min_tokens`` and
        ``logit_bias``; errors name the argument (the server's 400 names the field)."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(getattr(self, name), name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {getattr(self, name)!r}.")
            object.__setattr__(self, name, value)
        repetition = _as_float(self.repetition_penalty, "repetition_penalty")
        if not (math.isfinite(repetition) and repetition > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), "
                             f"got {self.repetition_penalty!r}.")
        min_p = _as_float(self.min_p, "min_p")
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}.")
        min_tokens = _as_int(self.min_tokens, "min_tokens")
        if not 0 <= min_tokens <= max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={max_tokens}], got {self.min_tokens!r}.")
        object.__setattr__(self, "repetition_penalty", repetition)
        object.__setattr__(self, "min_p", min_p)
        object.__setattr__(self, "min_tokens", min_tokens)
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether a penalty, ``min_p``, ``min_tokens`` or ``logit_bias`` is on: such a
        request samples in the programs that apply them (`jax_paged_attn.engine.penalties`);
        a batch without one runs the programs that skip them."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or self.min_p != 0.0 or self.min_tokens != 0 or bool(self.logit_bias))


def params_per_prompt(sampling_params: "SamplingParams | Sequence[SamplingParams] | None",
                      num_prompts: int) -> list[SamplingParams]:
    """One `SamplingParams` per prompt from what ``generate`` takes: one for all (None:
    the defaults, vLLM's) or a sequence of one per prompt. TypeError / ValueError name
    ``sampling_params``."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * num_prompts
    if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, (str, bytes)):
        params = list(sampling_params)
        if len(params) != num_prompts:
            raise ValueError(f"sampling_params has {len(params)} entries for {num_prompts} prompts; "
                             f"pass one SamplingParams or one per prompt.")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}.")
        return params
    raise TypeError(f"sampling_params must be a SamplingParams, a sequence of them or None, got "
                    f"{type(sampling_params).__name__}.")


def _logit_bias(value: object) -> dict[int, float] | None:
    """``logit_bias`` as ``{int: float}`` (None or empty: None); TypeError / ValueError
    naming ``logit_bias``. The ids are checked against the vocabulary by the engine."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"logit_bias must be a dict {{token_id: bias}} or None, got {type(value).__name__}.")
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(value)}.")
    bias = {}
    for token, amount in value.items():
        token_id = _as_int(token, "logit_bias token id")
        if token_id < 0:
            raise ValueError(f"logit_bias token ids must be >= 0, got {token!r}.")
        amount = _as_float(amount, f"logit_bias[{token_id}]")
        if not math.isfinite(amount):
            raise ValueError(f"logit_bias[{token_id}] must be finite, got {amount!r}.")
        bias[token_id] = amount
    return bias or None


def _as_float(x: object, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(x).__name__} {x!r}.")
    return float(x)


def as_bool(x: object, name: str) -> bool:
    """``x`` if it is a bool (Python's or NumPy's); TypeError naming ``name`` otherwise.
    Truthiness is not enough: a JSON or command-line ``"false"`` is a non-empty string."""
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__} {x!r}.")
    return bool(x)


def _as_int(x: object, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(x).__name__} {x!r}.")
    return int(x)


def greedy_tokens(logits: Array) -> Array:
    """int32 ``[B]``: the argmax of each row of ``logits`` ``[B, V]``."""
    return jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)


def sample_tokens(
    logits: Array,  # [B, V] any float dtype
    temperature: Array,  # f32[B], 0 = greedy
    top_p: Array,  # f32[B] in (0, 1]
    top_k: Array,  # i32[B], <= 0 disables
    seed: Array,  # u32[B]
    counter: Array,  # i32[B]
    min_p: Array | None = None,  # f32[B] in [0, 1]; None: no row uses it (a program without it)
) -> Array:
    """Draws one token per row; returns int32 ``[B]``. Jit-able; all arguments may be traced.

    Greedy rows take the argmax. Other rows divide the logits by their temperature,
    drop the tokens less likely than ``min_p`` times the most likely one (vLLM's
    ``MinPLogitsProcessor``), keep the top-k and then the top-p nucleus of what is left
    (always at least the most likely token) and sample with their own key
    ``fold_in(PRNGKey(seed), counter)``.

    Branchless: a batch known on the host to be all greedy should call `greedy_tokens`
    instead (a data-dependent ``lax.cond`` would make the jitted step wait for its
    predicate on the host, so nothing overlaps).
    """
    logits = logits.astype(jnp.float32)
    is_greedy = temperature <= 0.0
    vocab = logits.shape[-1]
    scaled = logits / jnp.where(is_greedy, 1.0, temperature)[:, None]
    if min_p is not None:
        probs = jax.nn.softmax(scaled, axis=-1)
        threshold = min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
        scaled = jnp.where(probs < threshold, -jnp.inf, scaled)
    order = jnp.argsort(-scaled, axis=-1)  # most likely first
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    rank = jnp.arange(vocab, dtype=jnp.int32)[None, :]
    keep = mass_before < top_p[:, None]
    keep &= (top_k[:, None] <= 0) | (rank < top_k[:, None])
    keep = keep.at[:, 0].set(True)
    masked = jnp.where(keep, sorted_logits, -jnp.inf)

    def draw(row_logits: Array, row_seed: Array, row_counter: Array) -> Array:
        key = jax.random.fold_in(jax.random.PRNGKey(row_seed), row_counter)
        return jax.random.categorical(key, row_logits)

    choice = jax.vmap(draw)(masked, seed, counter)
    tokens = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(is_greedy, greedy_tokens(logits), tokens)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """Log probabilities of sampled tokens, as the jitted programs return them.

    Leading dims ``[...]`` are ``[B]`` after one step and ``[K, R]`` after a decode
    window of K steps over R rows; ``n`` is the program's static ``num_logprobs``.

    Attributes:
      sampled_logprob: f32[...]: ``log_softmax(logits)`` at the sampled token.
      sampled_rank: i32[...]: 1 + the number of tokens with a strictly greater logprob.
      top_logprobs: f32[..., n]: the ``n`` largest logprobs, in decreasing order.
      top_ids: i32[..., n]: their token ids.
    """

    sampled_logprob: Array
    sampled_rank: Array
    top_logprobs: Array
    top_ids: Array


def token_logprobs(logits: Array, tokens: Array, num_logprobs: int) -> TokenLogprobs:
    """Logprobs of ``tokens`` i32[B] under ``logits`` [B, V] and the top ``num_logprobs``
    (static, <= V) of each row. Jit-able, branchless; float32 whatever the logits' dtype.

    The distribution is the raw one (``log_softmax`` of the logits, no temperature,
    top-p or top-k): see `SamplingParams.logprobs`.
    """
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    sampled = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    # A sum, not a sort: the rank costs one pass over the vocabulary.
    rank = 1 + jnp.sum(logprobs > sampled[:, None], axis=-1, dtype=jnp.int32)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, num_logprobs)
    return TokenLogprobs(sampled, rank, top_logprobs, top_ids.astype(jnp.int32))


def logprobs_bucket(requested: int, vocab_size: int) -> int:
    """The static ``num_logprobs`` of a program serving requests that ask up to
    ``requested`` top logprobs: rounded up to a power of two (at most `MAX_LOGPROBS`
    and the vocabulary), so a run compiles few logprobs variants."""
    if requested <= 0:
        return 0
    return min(1 << (requested - 1).bit_length(), MAX_LOGPROBS, vocab_size)


def logprob_dicts(token_ids: np.ndarray, result: Any, k: int) -> list[dict[int, Logprob]]:
    """Host side: one ``{token_id: Logprob}`` per sampled token, for a request asking ``k``.

    Args:
      token_ids: i64[N]: the sampled tokens.
      result: a `TokenLogprobs` with NumPy leaves, leading dim ``[N]`` (the tokens').
      k: the request's ``SamplingParams.logprobs`` (<= the program's ``num_logprobs``).

    Each dict holds the top ``k`` tokens in decreasing logprob, then the sampled token
    if it is not among them. A top token's rank is 1 + the number of top logprobs
    strictly greater than its own: exactly the vocabulary rank, since every token with
    a greater logprob is among the top ones.
    """
    dicts = []
    for j, token in enumerate(token_ids.tolist()):
        top = result.top_logprobs[j, :k]
        ranks = 1 + (top[None, :] > top[:, None]).sum(axis=1)
        entry = {int(t): Logprob(float(lp), int(r)) for t, lp, r in zip(result.top_ids[j, :k].tolist(), top, ranks)}
        if token not in entry:
            entry[token] = Logprob(float(result.sampled_logprob[j]), int(result.sampled_rank[j]))
        dicts.append(entry)
    return dicts
