"""Throughput accounting of `LLMEngine`: time spent compiling is compilation, not serving.

Every program the engine runs may compile inside a step: the model step and the decode
window (counted by the runner), and also the block moves: the swap-out / swap-in
programs and the host swap space (first preemption), the copy-on-write program. A step
in which anything compiled counts as a compiling step; its time goes to
``compile_time_s`` and stays out of the tok/s of the summary and of the progress bar.

No wall-clock: the engine's clock is a fake that advances 1 ms per reading, plus 100 s
for every XLA compilation (a JAX monitoring listener), so a rate that counted a
compilation would be off by orders of magnitude.
"""
from __future__ import annotations

import dataclasses
import re
import types

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import ENGINE_GROUP
from jax_paged_attn.engine import EngineConfig, LLMEngine, SamplingParams
from jax_paged_attn.engine import decode_batch, outputs, step_loop
from jax_paged_attn.engine import engine as engine_module
from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM

pytestmark = ENGINE_GROUP  # one worker compiles the tiny Llama's programs once (conftest.py)

BASE = EngineConfig(num_blocks=24, block_size=16, max_num_seqs=4, max_num_batched_tokens=32,
                    num_host_blocks=32, batch_buckets=(4,), token_buckets=(32,),
                    block_table_width_buckets=(16,), coarse_length_bounds=True, num_scheduler_steps=4,
                    compiler_options={"xla_backend_optimization_level": 0})
COMPILE_STALL_S = 100.0


class FakeClock:
    """``perf_counter`` of the engine: 1 ms per reading, + COMPILE_STALL_S per compilation."""

    def __init__(self) -> None:
        self.now = 0.0
        self.compilations = 0

    def perf_counter(self) -> float:
        self.now += 1e-3
        return self.now

    def on_event(self, event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.compilations += 1
            self.now += COMPILE_STALL_S


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    for module in (engine_module, step_loop, decode_batch, outputs):  # every engine room that reads the clock
        monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=fake.perf_counter))
    jax.monitoring.register_event_duration_secs_listener(fake.on_event)
    yield fake
    jax.monitoring.unregister_event_duration_listener(fake.on_event)


def test_swap_programs_compiled_in_a_step_count_as_compilation(clock, capsys):
    model = LlamaForCausalLM(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 128, size=n).tolist() for n in (40, 9, 50, 21)]
    params = SamplingParams(temperature=0.0, max_tokens=70)
    # Warm-up: the same run compiles every model program (shared by engines of one
    # model structure) and the swap programs for a host cache of 32 blocks.
    warm = LLMEngine(model, BASE)
    expected = [o.outputs[0].token_ids for o in warm.generate(prompts, params, use_tqdm=False)]
    assert warm.stats.num_swapped_out_blocks > 0
    # A host cache of another size: the same steps, but the swap programs (and the host
    # cache's allocation) compile again, inside steps whose model program is cached.
    engine = LLMEngine(model, dataclasses.replace(BASE, num_host_blocks=37))
    compilations = clock.compilations
    outs = engine.generate(prompts, params, use_tqdm=True)
    stats = engine.stats
    assert stats.num_swapped_out_blocks > 0
    assert engine.num_compiled_programs == 0  # no model program compiled ...
    assert clock.compilations > compilations  # ... but the swap programs did
    assert stats.compile_steps > 0 and stats.compile_time_s >= COMPILE_STALL_S
    assert stats.prefill_time_s + stats.decode_time_s < 1.0  # steps that only served, at 1 ms a reading
    assert stats.decode_tokens_per_s > 100 and stats.prefill_tokens_per_s > 100
    # The progress bar's rate leaves the compiling steps out too.
    rates = re.findall(r"([\d,]+) tok/s", capsys.readouterr().err)
    assert rates and float(rates[-1].replace(",", "")) > 100, rates[-5:]
    summary = stats.summary()
    assert f"in {stats.compile_steps} compiling steps" in summary
    assert [o.outputs[0].token_ids for o in outs] == expected
    # Once everything is compiled, no step counts as compiling (nothing else fires a
    # compilation event in a step), and no compilation stall is shown.
    again = LLMEngine(model, BASE)
    assert [o.outputs[0].token_ids for o in again.generate(prompts, params, use_tqdm=False)] == expected
    assert again.stats.compile_steps == 0 and again.stats.compile_time_s == 0.0
    assert again.stats.num_swapped_out_blocks > 0
