"""The block moves a `SchedulerOutput` orders before its step: swap-outs to the host
swap space (allocated at the first one), copy-on-write copies, swap-ins, on the
runner's KV caches, in that order."""
from __future__ import annotations

import jax
import numpy as np

from jax_paged_attn import cache as cache_ops
from jax_paged_attn.engine.config import EngineConfig
from jax_paged_attn.engine.model_runner import CausalLM, ModelRunner
from jax_paged_attn.engine.request import SchedulerOutput
from jax_paged_attn.engine.stats import StatsRecorder
from jax_paged_attn.tuning import next_power_of_2

Array = jax.Array

copy_blocks_donated = jax.jit(cache_ops.copy_kv_cache_blocks, donate_argnums=(0,))
"""Copy-on-write over every layer's cache, in place (the caches are donated)."""


class BlockMoves:
    """Runs a step's block moves on ``runner``'s caches; owns the host swap space."""

    def __init__(self, model: CausalLM, runner: ModelRunner, config: EngineConfig, recorder: StatsRecorder) -> None:
        self.model = model
        self.runner = runner
        self.config = config
        self.recorder = recorder
        self.host_caches: list[Array] | None = None

    def host_swap_space(self) -> list[Array]:
        """The host caches swapped-out blocks live in, one per layer (``num_host_blocks``
        blocks each), allocated at the first swap."""
        if self.host_caches is None:
            # The device caches' head count, not the config's: a tensor-parallel model may
            # store each KV head several times (`LlamaForCausalLM.kv_head_replicas`).
            num_kv_heads, head_dim = self.runner.kv_caches[0].shape[-2:]
            self.host_caches = [
                cache_ops.allocate_host_kv_cache(
                    self.config.num_host_blocks, self.config.block_size, num_kv_heads, head_dim,
                    kv_cache_dtype=self.model.kv_cache_dtype, model_dtype=self.model.dtype, sharding=None,
                )
                for _ in self.runner.kv_caches
            ]
        return self.host_caches

    def run(self, out: SchedulerOutput) -> None:
        """Swap-outs, copy-on-write copies, swap-ins, in the order `SchedulerOutput` requires."""
        runner = self.runner
        if out.swap_out:
            mapping = np.asarray(out.swap_out, np.int32)
            host = self.host_swap_space()
            self.host_caches = [cache_ops.swap_blocks(dev, h, mapping) for dev, h in zip(runner.kv_caches, host)]
        if out.copies:
            n = len(out.copies)
            mapping = np.full((next_power_of_2(n), 2), cache_ops.PAD_BLOCK_ID, np.int32)  # few programs
            mapping[:n] = out.copies
            runner.kv_caches = copy_blocks_donated(runner.kv_caches, mapping)
            self.recorder.stats.num_copied_blocks += n
        if out.swap_in:
            mapping = np.asarray(out.swap_in, np.int32)
            host = self.host_swap_space()
            runner.kv_caches = [cache_ops.swap_blocks(h, dev, mapping) for h, dev in zip(host, runner.kv_caches)]
