"""The static description of one attention call, shared by every implementation.

`AttentionSpec` holds everything that changes the *program* (not the data) of an
attention call: the softmax scale, causality, the sliding window, the soft-cap and
whether ALiBi slopes are given. It is frozen and hashable, so it can be a static
argument of `jax.jit` and a key of a tuning table. Arrays (q, k, v, lengths, block
tables, ALiBi slopes, fp8 scales) are never part of it.

Mask convention (flash-attention 2, as vLLM uses it). For one sequence with Sq
queries and Sk keys, query i is aligned with key ``i + Sk - Sq`` (bottom-right):

    causal, Sq=2, Sk=5 (1 = attended)      window_size=(1, 0), Sq=Sk=4
        k: 0 1 2 3 4                          k: 0 1 2 3
    q0:    1 1 1 1 0                      q0:    1 0 0 0
    q1:    1 1 1 1 1                      q1:    1 1 0 0
                                          q2:    0 1 1 0
                                          q3:    0 0 1 1

Key j is visible to query i iff, with ``d = i + Sk - Sq``:
``j <= d`` when causal, ``j >= d - left`` when ``left >= 0``, ``j <= d + right``
when ``right >= 0``. ALiBi adds ``-slope[h] * |d - j|`` after the soft-cap.

The padding ids of the cache's mappings (`PAD_SLOT_ID`, `PAD_BLOCK_ID`) live here too:
every layer (cache ops, metadata, kernels, engine) agrees on them.
"""
from __future__ import annotations

import dataclasses
import math

UNBOUNDED = -1
"""Value of a window side that does not limit attention (flash-attention's -1)."""

PAD_SLOT_ID = -1
"""Slot-mapping entry of a token whose key / value is not written (padding)."""

PAD_BLOCK_ID = -1
"""Block-mapping entry (in either column) of a (src, dst) pair that is skipped."""


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Static (compile-time) parameters of one attention call.

    Attributes:
      softmax_scale: multiplies q·k before the soft-cap; flash-attention's default
        is ``1/sqrt(head_size)`` (see `AttentionSpec.create`).
      causal: bottom-right aligned causal mask.
      window_left: keys more than this many positions left of the aligned diagonal
        are masked; ``UNBOUNDED`` (-1) for no limit.
      window_right: keys more than this many positions right of the diagonal are
        masked; ``UNBOUNDED`` for no limit. Forced to 0 when ``causal``.
      softcap: if > 0, scores become ``softcap * tanh(scores / softcap)``.
      has_alibi: ALiBi slopes are passed (as an array, not part of the spec).
    """

    softmax_scale: float
    causal: bool = False
    window_left: int = UNBOUNDED
    window_right: int = UNBOUNDED
    softcap: float = 0.0
    has_alibi: bool = False

    @staticmethod
    def create(
        head_size: int,
        *,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (UNBOUNDED, UNBOUNDED),
        softcap: float | None = 0.0,
        has_alibi: bool = False,
    ) -> "AttentionSpec":
        """Normalizes flash-attention style arguments; raises on invalid ones."""
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(head_size)
        try:
            softmax_scale = float(softmax_scale)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"softmax_scale must be a Python number (it is static), got {type(softmax_scale)}"
            ) from e
        if not math.isfinite(softmax_scale) or softmax_scale <= 0:
            raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale}")
        if (
            not isinstance(window_size, (tuple, list))
            or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)
        ):
            raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
        left, right = int(window_size[0]), int(window_size[1])
        if left < UNBOUNDED or right < UNBOUNDED:
            raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {window_size!r}")
        if causal:
            right = 0
        softcap = 0.0 if softcap is None else float(softcap)
        if not math.isfinite(softcap) or softcap < 0:
            raise ValueError(f"softcap must be >= 0 (0 disables it), got {softcap}")
        return AttentionSpec(
            softmax_scale=softmax_scale,
            causal=bool(causal),
            window_left=left,
            window_right=right,
            softcap=softcap,
            has_alibi=bool(has_alibi),
        )

    @property
    def is_local(self) -> bool:
        """True when a sliding window limits the keys on either side (besides causality)."""
        return self.window_left >= 0 or (self.window_right >= 0 and not self.causal)
