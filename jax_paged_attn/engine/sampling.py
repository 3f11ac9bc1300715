"""Per-request sampling parameters and the jit-able batched sampler.

`SamplingParams` is what a user passes with each request (vLLM's names). It is
validated on construction, so a bad request fails in ``add_request`` and never reaches
a batch. `sample_tokens` runs inside the engine's jitted step: one row of logits per
sequence, each row with its own temperature / top-p / top-k and its own PRNG stream.

Randomness: request r draws its t-th token with
``fold_in(PRNGKey(seed_r), t)``, so a seeded request produces the same tokens whatever
else shares its batch and whatever step it runs in.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

TOP_K_DISABLED = -1
"""``top_k`` value that keeps the whole vocabulary (vLLM's -1; 0 is accepted too)."""


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
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_DISABLED
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

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
            stop = tuple(_as_int(t, "stop_token_ids") for t in self.stop_token_ids)
        except TypeError as e:
            raise TypeError(f"stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}.") from e
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "top_k", TOP_K_DISABLED if top_k == 0 else top_k)
        object.__setattr__(self, "max_tokens", max_tokens)
        object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "stop_token_ids", stop)
        object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _as_float(x: object, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(x).__name__} {x!r}.")
    return float(x)


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
) -> Array:
    """Draws one token per row; returns int32 ``[B]``. Jit-able; all arguments may be traced.

    Greedy rows take the argmax. Other rows divide the logits by their temperature,
    keep the top-k and then the top-p nucleus (always at least the most likely
    token) and sample with their own key ``fold_in(PRNGKey(seed), counter)``.

    Branchless: a batch known on the host to be all greedy should call `greedy_tokens`
    instead (a data-dependent ``lax.cond`` would make the jitted step wait for its
    predicate on the host, so nothing overlaps).
    """
    logits = logits.astype(jnp.float32)
    is_greedy = temperature <= 0.0
    vocab = logits.shape[-1]
    scaled = logits / jnp.where(is_greedy, 1.0, temperature)[:, None]
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
