"""Warm-up: one task per program (shape) the configuration reaches, and `WarmupReport`,
what `LLMEngine.warmup` did.

A program compiles once per distinct *static* shape of its inputs, and the engine pads
every batch to one of the few shapes `jax_paged_attn.engine.shapes` fixes at start.
`LLMEngine.warmup` (which `LLM` calls) runs every task here once, on padding, so no
later call compiles; with ``EngineConfig.compilation_cache`` a second start loads them
instead (the engine's program store, `jax_paged_attn.engine.program_store`, untraced;
anything else from JAX's persistent compilation cache).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from jax_paged_attn import cache as cache_ops
from jax_paged_attn.engine.block_moves import copy_blocks_donated
from jax_paged_attn.engine.config import EngineConfig, window_step_counts
from jax_paged_attn.engine.model_runner import DecodeState, ModelRunner
from jax_paged_attn.engine.penalties import StepPenalties
from jax_paged_attn.engine.shapes import ProgramShapes
from jax_paged_attn.engine.step_inputs import StepInputs
from jax_paged_attn.tuning import next_power_of_2


@dataclasses.dataclass(frozen=True)
class WarmupReport:
    """What `LLMEngine.warmup` did: programs (shapes) run, XLA compilations they took
    (``num_compiled``, JAX's count, which includes the ``num_cache_hits`` executables
    loaded from the persistent compilation cache instead), seconds in all and for the
    slowest program."""

    num_programs: int
    num_compiled: int
    num_cache_hits: int
    seconds: float
    slowest_program_s: float

    def __str__(self) -> str:
        return (f"{self.num_programs} programs ready in {self.seconds:.1f} s (slowest {self.slowest_program_s:.1f} s; "
                f"{self.num_compiled - self.num_cache_hits} XLA compilations, {self.num_cache_hits} programs "
                f"loaded from the compilation cache)")


def warmup_tasks(shapes: ProgramShapes, cfg: EngineConfig, runner: ModelRunner, step_inputs: StepInputs,
                 vocab_size: int) -> list[Any]:
    """One callable per program (shape) that `LLMEngine.warmup` runs (``cfg``: the
    engine's configuration, resolved at start).

    Each shape has three variants: greedy, sampled, and sampled with `Penalties` (the
    penalties, ``logit_bias``, ``min_tokens``, ``min_p``; a greedy request using them
    runs in that variant, so there is no fourth)."""
    num_stop_ids = shapes.num_stop_id_columns
    tasks: list[Any] = []

    def decode_state(num_rows: int, width: int, penalized: bool) -> DecodeState:
        return DecodeState.empty(num_rows, width, num_stop_ids, vocab_size if penalized else None)

    def prompt_penalties(num_seqs: int, penalized: bool) -> StepPenalties | None:
        return step_inputs.neutral_penalties(num_seqs) if penalized else None

    def no_row_update(num_rows: int, width: int) -> tuple[np.ndarray, ...]:
        # (keep, block_rows, block_values): every row stopped, no block-table row changed.
        return (np.zeros(num_rows, bool), np.full(num_rows, num_rows, np.int32),
                np.zeros((num_rows, width), np.int32))

    def window(num_rows: int, width: int, num_steps: int, greedy: bool, penalized: bool) -> None:
        runner.start_decode(decode_state(num_rows, width, penalized))
        runner.insert_decode_rows(np.full(num_rows, num_rows, np.int32), decode_state(num_rows, width, penalized))
        runner.run_decode_window(*no_row_update(num_rows, width), num_steps=num_steps,
                                 greedy=greedy, max_model_len=cfg.max_model_len)

    def mixed(num_rows: int, prompt_shape: tuple[int, int], greedy: bool, penalized: bool) -> None:
        width = shapes.block_table_width
        runner.start_decode(decode_state(num_rows, width, penalized))
        inputs = step_inputs.padding_prompt_inputs(*prompt_shape)
        num_seqs = prompt_shape[1]
        no_join = (np.full(num_seqs, num_rows, np.int32), DecodeState.empty(num_seqs, width, num_stop_ids))
        runner.run_mixed(*no_row_update(num_rows, width), *inputs, *no_join, prompt_penalties(num_seqs, penalized),
                         greedy=greedy, max_model_len=cfg.max_model_len)

    def prompts(prompt_shape: tuple[int, int], greedy: bool, penalized: bool) -> None:
        runner.run_step(*step_inputs.padding_prompt_inputs(*prompt_shape),
                        prompt_penalties(prompt_shape[1], penalized), greedy=greedy)

    def copies(num_pairs: int) -> None:
        mapping = np.full((num_pairs, 2), cache_ops.PAD_BLOCK_ID, np.int32)
        runner.kv_caches = copy_blocks_donated(runner.kv_caches, mapping)

    variants = ((True, False), (False, False)) + (((False, True),) if cfg.warmup_penalties else ())
    for greedy, penalized in variants:
        for width in shapes.window_widths:
            for num_rows in shapes.decode_rows:
                for num_steps in window_step_counts(cfg):
                    tasks.append(functools.partial(window, num_rows, width, num_steps, greedy, penalized))
        for prompt_shape in shapes.prompt_shapes:
            if cfg.decode_during_prefill:
                for num_rows in shapes.mixed_rows:
                    tasks.append(functools.partial(mixed, num_rows, prompt_shape, greedy, penalized))
            else:
                tasks.append(functools.partial(prompts, prompt_shape, greedy, penalized))
    if cfg.enable_prefix_caching:
        num_pairs = 1
        while num_pairs <= next_power_of_2(shapes.max_prompts_per_step):
            tasks.append(functools.partial(copies, num_pairs))
            num_pairs *= 2
    return tasks
