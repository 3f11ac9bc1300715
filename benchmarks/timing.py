"""The timing harness: how a call's device time is sampled, budgeted and compared.

Owns: `Timer` (warm-up calls, then the median of samples of back-to-back calls; JAX and
torch), the time budget (`Deadline`, `OutOfTime`) and `Unavailable` (a peer that cannot
run here), `Measurement` and `Context` (what every implementation runner gets: timing,
budget, run options, torch, config sweeps), `short_error`, the conversions of outputs
to float32 numpy, and the alternating rounds of the parts scripts (`compare_kernels`,
`one_call_ms`). A suite's jobs, their rounds and their child processes are `jobs.py`'s.
"""
from __future__ import annotations

import dataclasses
import pathlib
import statistics
import time
import traceback
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_paged_attn import tune

Array = jax.Array


# =========================================================================== timing


class OutOfTime(Exception):
    """The suite's share of the time budget is spent."""


class Unavailable(Exception):
    """The peer cannot run here (library missing, shape it does not support by design)."""


@dataclasses.dataclass
class Deadline:
    end: float  # time.monotonic() value

    def expired(self) -> bool:
        return time.monotonic() >= self.end

    def check(self) -> None:
        if self.expired():
            raise OutOfTime("time budget of the suite spent")


@dataclasses.dataclass
class Measurement:
    ms: float  # median of the timed calls
    compile_s: float  # first call (compile + run)
    output: Any = None  # last call's output (canonical layout, float32 numpy) or None
    config: str | None = None
    note: str = ""
    sweep: list[dict[str, Any]] | None = None
    # Times the same compiled call again (ms; no compile): the alternating rounds (`run_jobs`).
    retime: Callable[[], float] | None = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass
class Timer:
    """Warm-up calls, then the median of ``reps`` timed samples: device time per call.

    A sample is ``calls`` back-to-back calls, divided by ``calls``. JAX: one
    `jax.block_until_ready` at the end; dispatch is asynchronous, so the host's
    per-call dispatch (tens of microseconds, more than a third of a 0.3 ms decode step)
    overlaps the previous call's GPU work instead of being counted, as in the jitted
    loops that run these ops. torch: CUDA events around the sample's calls. ``calls`` is
    chosen so that a sample lasts at least ``sample_ms`` (at least ``min_calls``, at
    most ``max_calls``): a sample's fixed cost (its first launch, the final wait) is
    spread over enough calls to vanish. With 2 ms samples it was not: the B64 ctx4096
    decode call read 3,164 GB/s that way on the H200, 4,028 with 40 ms samples and
    3,844 in a jitted loop of 20 calls (2026-12-04). `dry_run`: the fewest calls, for
    a CPU run that checks a script (its times mean nothing there; an interpret-mode
    kernel call takes seconds).
    """

    warmup: int = 3
    reps: int = 10
    sample_ms: float = 25.0
    min_calls: int = 2
    max_calls: int = 256

    @classmethod
    def dry_run(cls) -> "Timer":
        """One untimed call and one timed sample of one call."""
        return cls(warmup=1, reps=1, min_calls=1)

    def _calls(self, single_ms: float) -> int:
        return tune.calls_per_sample(single_ms, self.sample_ms, self.min_calls, self.max_calls)

    def jax(self, call: Callable[[], Any]) -> tuple[float, float, Any]:
        """Returns (median ms per call, first-call seconds, last output) of the zero-arg `call`."""
        return tune.time_jax(call, self.warmup, self.reps, self.sample_ms, self.min_calls, self.max_calls)

    def torch(self, torch: Any, call: Callable[[], Any]) -> tuple[float, float, Any]:
        start = time.perf_counter()
        out = call()
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
        single_ms = compile_s * 1e3
        for _ in range(self.warmup - 1):
            start = time.perf_counter()
            out = call()
            torch.cuda.synchronize()
            single_ms = (time.perf_counter() - start) * 1e3
        calls = self._calls(single_ms)
        times = []
        for _ in range(self.reps):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(calls):
                out = call()
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end) / calls)
        return statistics.median(times), compile_s, out


def short_error(error: BaseException, limit: int = 600) -> str:
    """``Type: message`` on one line (without the notes JAX appends about tracebacks);
    a bare ``assert`` gets the file and line that raised it."""
    message = str(error).strip()
    if not message and error.__traceback__ is not None:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        message = f"at {pathlib.Path(frame.filename).name}:{frame.lineno}: {frame.line}"
    return " ".join(f"{type(error).__name__}: {message}".split())[:limit]


@dataclasses.dataclass
class Context:
    """What every implementation runner gets: timing, budget and run options."""

    timer: Timer
    deadline: Deadline
    ours_implementation: str = "triton"
    interpret: bool = False
    quick: bool = False
    max_configs: int = 0  # a sweep's first configs only (0: all)
    rounds: int = 1  # timings of every measured call, in alternating rounds (`run_jobs`)
    _torch: Any = None

    def time_jax(self, call: Callable[[], Any], to_numpy: Callable[[Any], np.ndarray] | None = None,
                 **fields: Any) -> Measurement:
        self.deadline.check()
        ms, compile_s, out = self.timer.jax(call)
        return Measurement(ms, compile_s, None if to_numpy is None else to_numpy(out),
                           retime=self._retimer(lambda: self.timer.jax(call)[0]), **fields)

    def _retimer(self, retime: Callable[[], float]) -> Callable[[], float] | None:
        """``retime`` where the run times in rounds (`run_jobs`); None measures once."""
        return retime if self.rounds > 1 else None

    def sweep(self, configs: Sequence[Any], make_call: Callable[[Any], Callable[[], Any]],
              describe: Callable[[Any], str] = repr,
              to_numpy: Callable[[Any], np.ndarray] | None = None) -> Measurement:
        """Times every config (failures and budget stops noted), returns the fastest."""
        best, best_out, trials = None, None, []
        if self.max_configs:
            configs = list(configs)[:self.max_configs]
        for config in configs:
            name = describe(config)
            if self.deadline.expired():
                trials.append({"config": name, "skipped": "time budget"})
                continue
            try:
                call = make_call(config)
                ms, compile_s, out = self.timer.jax(call)
            except Exception as e:  # noqa: BLE001 - one config failing must not stop the sweep
                trials.append({"config": name, "error": short_error(e, 300)})
                continue
            trials.append({"config": name, "ms": ms, "compile_s": compile_s})
            if best is None or ms < best[0]:
                best, best_out, best_call = (ms, compile_s, name), out, call
        if best is None:
            if all("skipped" in t for t in trials):
                raise OutOfTime("time budget of the suite spent before any config ran")
            reasons = list(dict.fromkeys(t.get("error") or t.get("skipped") for t in trials))
            where = "every config" if len(reasons) == 1 else "; ".join(
                f"{t['config']}: {t.get('error') or t.get('skipped')}" for t in trials)
            raise RuntimeError(f"no config ran ({reasons[0] if len(reasons) == 1 else where}) "
                               f"[{len(trials)} configs]"[:600])
        ok = sum("ms" in t for t in trials)
        return Measurement(best[0], best[1], None if to_numpy is None else to_numpy(best_out),
                           config=best[2], note=f"best of {ok}/{len(trials)} configs", sweep=trials,
                           retime=self._retimer(lambda: self.timer.jax(best_call)[0]))

    @property
    def torch(self) -> Any:
        """The torch module with CUDA, or `Unavailable`."""
        if self._torch is None:
            try:
                import torch
            except Exception as e:  # noqa: BLE001
                raise Unavailable(f"torch not importable: {short_error(e, 200)}") from e
            if not torch.cuda.is_available():
                raise Unavailable("torch has no CUDA device")
            self._torch = torch
        return self._torch

    def to_torch(self, x: Array) -> Any:
        """A CUDA torch tensor with x's values (zero-copy through DLPack when possible)."""
        torch = self.torch
        try:
            return torch.from_dlpack(x)
        except Exception:  # noqa: BLE001 - older pairs of versions: go through the host
            host = np.asarray(x.astype(jnp.float32))
            return torch.from_numpy(host).cuda().to(getattr(torch, str(x.dtype)))

    def time_torch(self, call: Callable[[], Any], to_numpy: Callable[[Any], np.ndarray] | None = None,
                   **fields: Any) -> Measurement:
        self.deadline.check()
        ms, compile_s, out = self.timer.torch(self.torch, call)
        return Measurement(ms, compile_s, None if to_numpy is None else to_numpy(out),
                           retime=self._retimer(lambda: self.timer.torch(self.torch, call)[0]), **fields)


def to_numpy(x: Any) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


def torch_to_numpy(x: Any) -> np.ndarray:
    return x.float().cpu().numpy()


# --------------------------------------------------------------------------- the parts scripts' rounds


def compare_kernels(calls, timer, rounds: int) -> list[float]:
    """Median ms of each call, timed in alternating rounds (first, second, ..., first, ...)
    in one process: the H200 varies by up to ~15 % between processes, so a comparison of
    configs read across processes can flip."""
    times = [[] for _ in calls]
    for _ in range(rounds):
        for call, kept in zip(calls, times):
            kept.append(timer.jax(call)[0])
    return [statistics.median(kept) for kept in times]


def one_call_ms(call, reps: int) -> float:
    """Median wall time of ``reps`` calls made one at a time, each waited for (host
    dispatch and the wait included: tens of µs). Beside the back-to-back timing it
    would tell a cost that only consecutive calls pay (none found: the persistent
    form's 2x over its profiled span came from reading the span at the maximum clock)."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


# =========================================================================== device copy rate

H200_COPY_RATE = 4.2e12
"""bytes/s: an H200's measured device-to-device copy rate (read + write), the floor's rate
where no GPU is present to measure one."""

_copy_rates: dict[str, float] = {}


def device_copy_rate(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """The device's copy rate in bytes/s (bytes read + written per second by one elementwise
    pass over ``nbytes``), measured once per process: the bandwidth the weight-read floors
    divide by, so each GPU's floor is its own (an H100's is ~30 % below an H200's). Without
    a GPU, `H200_COPY_RATE`, said once."""
    device = jax.devices()[0]
    key = device.device_kind
    if key not in _copy_rates:
        if device.platform != "gpu":
            print(f"no GPU to measure the copy rate on ({key}): floors use an H200's "
                  f"{H200_COPY_RATE / 1e12:.1f} TB/s")
            _copy_rates[key] = H200_COPY_RATE
        else:
            # Negation, not a copy: XLA may alias an identity copy away.
            step = jax.jit(jnp.negative)
            x = jnp.zeros(nbytes // 2, jnp.bfloat16)
            jax.block_until_ready(step(x))
            start = time.perf_counter()
            for _ in range(reps):
                x = step(x)
            jax.block_until_ready(x)
            _copy_rates[key] = 2 * nbytes * reps / (time.perf_counter() - start)
            print(f"device copy rate ({key}): {_copy_rates[key] / 1e12:.2f} TB/s (read + write), the floors' rate")
    return _copy_rates[key]
