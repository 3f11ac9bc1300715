"""A suite's jobs: the rows they produce, how they run, their alternating rounds and
the child processes that isolate each suite.

Owns: `Row` (one measurement or failure, a JSON record) with its throughput and log
line; `Job` (an implementation, or a config of ours, on a shape); `SuiteRunner` (runs
jobs in this process, checks every output against ours or the expected cache rows);
`run_jobs` (rows emitted as measured, then the alternating rounds); and
`run_suite_isolated` (a suite's jobs in child processes of ``bench_attention.py``, a
crashed job recorded and the suite resumed after it). Which jobs a run plans is
``bench_attention.py``'s (`plan_jobs`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

from cache_peers import expected_cache_rows
from peers import Impl
from suites import INPUT_BUILDERS
from sweeps import decode_table_key, decode_with_config, prefill_table_key, prefill_with_config, table_choice
from timing import Context, Deadline, OutOfTime, Unavailable, short_error

BENCH_ATTENTION = pathlib.Path(__file__).resolve().parent / "bench_attention.py"
"""The script a suite's child process runs (`run_suite_isolated`)."""


# =========================================================================== rows


@dataclasses.dataclass
class Row:
    """One measurement (or failure) of one implementation on one shape: a JSON record."""

    suite: str
    case: str
    impl: str
    is_ours: bool
    metric: str
    work: float  # bytes or flops credited to every implementation of this shape
    status: str  # "ok" | "failed" | "skipped"
    ms: float | None = None
    value: float | None = None  # GB/s or TFLOP/s
    compile_s: float | None = None
    config: str | None = None
    note: str = ""
    error: str | None = None
    check_max_abs_diff: float | None = None
    check_against: str | None = None
    sweep: list[dict[str, Any]] | None = None
    rounds_ms: list[float] | None = None  # ms of each alternating round (`run_jobs`); ms is their median
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    # tuning rows only
    table: str | None = None
    table_key: str | None = None
    is_default_config: bool = False


def metric_of(suite: str) -> str:
    return "GB/s" if suite in ("decode", "cache") else "TFLOP/s"


def throughput(work: float, ms: float, metric: str) -> float:
    """GB/s (1e9 bytes/s) or TFLOP/s (1e12 flop/s) from work and milliseconds."""
    per_second = work / (ms * 1e-3)
    return per_second / (1e9 if metric == "GB/s" else 1e12)


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        raise ValueError(f"output shape {a.shape} != {b.shape}")
    return float(np.max(np.abs(a - b), initial=0.0))


def log_row(row: Row) -> None:
    if row.status == "ok":
        extra = f" {row.config}" if row.config else ""
        if row.check_max_abs_diff is not None:
            extra += f" |Δ|={row.check_max_abs_diff:.3g}"
        print(f"[{row.suite}] {row.impl:<20} {row.case:<52} {row.ms:9.4f} ms {row.value:9.1f} {row.metric}"
              f" (first call {row.compile_s:.1f} s){extra}", flush=True)
    else:
        print(f"[{row.suite}] {row.impl:<20} {row.case:<52} {row.status}: {row.error}", flush=True)


# =========================================================================== jobs


@dataclasses.dataclass(frozen=True)
class Job:
    """One row to produce: an implementation on a shape, or (tuning) one config of ours on a shape."""

    suite: str
    case: Any
    impl: Impl | None = None  # benchmark jobs
    config: Any = None  # tuning jobs

    def blank_row(self) -> Row:
        suite, case = self.suite, self.case
        row = Row(suite, case.label, self.impl.name if self.impl else "ours",
                  self.impl.is_ours if self.impl else True, metric_of(suite), float(case.work), "ok",
                  params=dataclasses.asdict(case))
        if self.config is not None:
            row.config = repr(self.config)
            row.table = "DECODE_TABLE" if suite == "decode" else "PREFILL_TABLE"
            row.table_key = decode_table_key(case) if suite == "decode" else prefill_table_key(case)
            row.is_default_config = self.config == table_choice(suite, case)
        return row


class SuiteRunner:
    """Runs jobs of one suite in this process. Keeps each shape's inputs and ours' output
    (to compare every peer's output with it)."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self._inputs: dict[Any, Any] = {}
        self._ours_output: dict[Any, np.ndarray] = {}

    def inputs(self, suite: str, case: Any) -> Any:
        if case not in self._inputs:
            try:
                self._inputs[case] = INPUT_BUILDERS[suite](case)
            except Exception as e:  # noqa: BLE001 - remembered: every job of this shape fails alike
                self._inputs[case] = RuntimeError(f"building inputs: {short_error(e)}")
        if isinstance(self._inputs[case], Exception):
            raise self._inputs[case]
        return self._inputs[case]

    def run(self, job: Job) -> tuple[Row, Callable[[], float] | None]:
        """One job and its measured call's `Measurement.retime` (None where there is none);
        never raises (failures and skips are recorded in the row)."""
        row, retime = job.blank_row(), None
        try:
            self.ctx.deadline.check()
            x = self.inputs(job.suite, job.case)
            if job.config is not None:
                make_call = decode_with_config if job.suite == "decode" else prefill_with_config
                row.ms, row.compile_s, _ = self.ctx.timer.jax(make_call(self.ctx, job.case, x, job.config))
            else:
                result = job.impl.run(self.ctx, job.case, x)
                row.ms, row.compile_s, retime = result.ms, result.compile_s, result.retime
                row.config, row.note, row.sweep = result.config, result.note, result.sweep
                self._check(job, x, row, result.output)
            row.value = throughput(row.work, row.ms, row.metric)
        except (OutOfTime, Unavailable) as e:
            row.status, row.error = "skipped", str(e)
        except Exception as e:  # noqa: BLE001 - every implementation is isolated from the others
            row.status, row.error = "failed", short_error(e)
        return row, retime

    def _check(self, job: Job, x: Any, row: Row, output: np.ndarray | None) -> None:
        """Cache writes: against the expected cache rows. Attention: against ours."""
        if output is None:
            return
        if job.suite == "cache":
            reference, against = expected_cache_rows(job.case, x), "expected"
        elif job.impl.is_ours:
            self._ours_output[job.case] = output
            return
        else:
            reference, against = self._ours_output.get(job.case), "ours"
        if reference is None:
            return
        try:
            row.check_max_abs_diff, row.check_against = max_abs_diff(output, reference), against
        except ValueError as e:
            row.note = (row.note + "; " if row.note else "") + f"not compared: {e}"


Emit = Callable[[Row, "int | None"], None]
"""Receives each job's row as it is measured (``None``), then, after the alternating
rounds, the row again with the index of the row it replaces among this call's rows."""


def run_jobs(jobs: Sequence[Job], ctx: Context, emit: Emit) -> None:
    """Runs the jobs in order, emitting each row as soon as it is measured (a crash loses
    only the job it happens in). Then, with ``ctx.rounds`` > 1, times every measured call
    again in ``ctx.rounds - 1`` more rounds, all of the suite's calls in job order per
    round (implementations and shapes alternating, as `prefill_parts.py --versus` does),
    while the suite's budget lasts: each row's ms becomes the median of its rounds
    (``rounds_ms``), so a GPU's drift between one implementation's turn and the next's (up
    to ~10 % between runs on the H200) reaches every column alike. Re-emits the rows it
    re-timed."""
    runner = SuiteRunner(ctx)
    timed = []  # (index, row, retime) of the rows to time again
    for i, job in enumerate(jobs):
        row, retime = runner.run(job)
        log_row(row)
        emit(row, None)
        if row.status == "ok" and retime is not None:
            timed.append((i, row, retime))
    for _, row, _ in timed:
        row.rounds_ms = [row.ms]
    for _ in range(ctx.rounds - 1):
        for _, row, retime in timed:
            if ctx.deadline.expired():
                break
            try:
                row.rounds_ms.append(retime())
            except Exception as e:  # noqa: BLE001 - keep the rounds it has
                row.note = (row.note + "; " if row.note else "") + f"a later round failed: {short_error(e, 200)}"
    for i, row, _ in timed:
        if len(row.rounds_ms) > 1:
            row.ms = statistics.median(row.rounds_ms)
            row.value = throughput(row.work, row.ms, row.metric)
            emit(row, i)


# =========================================================================== one process per suite

CHILD_GRACE_S = 120.0
"""A suite's process may overrun its share by this much (one long compile) before it is killed."""
MAX_RESTARTS = 3


def spawn(command: list[str], timeout_s: float) -> str | int:
    """Runs a child process (its output goes to ours); its exit code or 'timed out'.
    An infinite ``timeout_s`` (``--budget-s inf``) waits as long as the child runs."""
    try:
        return subprocess.run(command, timeout=timeout_s if math.isfinite(timeout_s) else None).returncode
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout_s:.0f} s"


REPLACES = "replaces_row"
"""Key of a child's JSON line that replaces an earlier row of that child (its index):
the row again after the alternating rounds (`run_jobs`)."""


def _read_rows(path: pathlib.Path) -> list[dict[str, Any]]:
    """A child's rows, each line a row or (`REPLACES`) a new version of an earlier one."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash
            break
        if REPLACES in record:
            rows[record.pop(REPLACES)] = record
        else:
            rows.append(record)
    return rows


def run_suite_isolated(suite: str, jobs: Sequence[Job], args: argparse.Namespace, deadline: Deadline,
                       workdir: pathlib.Path, spawn_fn: Callable[[list[str], float], str | int] = spawn,
                       script: pathlib.Path = BENCH_ATTENTION) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Runs the suite's jobs in child processes (``script`` with the run's forwarded
    options, `args.forwarded`): a job that kills its process (a CUDA fault poisons the
    whole context) is recorded as failed and the suite resumes after it in a fresh
    process, up to `MAX_RESTARTS` times. Returns (rows, device meta)."""
    rows: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    start, restarts = 0, 0
    while start < len(jobs):
        rows_path = workdir / f"{suite}.{restarts}.jsonl"
        meta_path = workdir / f"{suite}.{restarts}.meta.json"
        command = [sys.executable, str(script), *args.forwarded, "--suite", suite,
                   "--child-start", str(start), "--child-deadline", repr(deadline.end),
                   "--child-rows", str(rows_path), "--child-meta", str(meta_path)]
        outcome = spawn_fn(command, max(60.0, deadline.end - time.monotonic()) + CHILD_GRACE_S)
        new_rows = _read_rows(rows_path)
        rows += new_rows
        start += len(new_rows)
        if meta_path.exists() and not meta:
            meta = json.loads(meta_path.read_text())
        if start >= len(jobs):
            break
        how = outcome if isinstance(outcome, str) else f"exit code {outcome}"
        if not new_rows and not meta_path.exists():  # it never got to its first job
            for job in jobs[start:]:
                failed = job.blank_row()
                failed.status, failed.error = "failed", f"the suite's process did not start ({how}); see its output"
                rows.append(dataclasses.asdict(failed))
            break
        crashed = jobs[start].blank_row()
        crashed.status = "failed"
        crashed.error = f"the suite's process ended during this job ({how})"
        log_row(crashed)
        rows.append(dataclasses.asdict(crashed))
        start += 1
        restarts += 1
        if restarts > MAX_RESTARTS or deadline.expired():
            for job in jobs[start:]:
                skipped = job.blank_row()
                skipped.status, skipped.error = "skipped", "not run: the suite's process kept dying or time ran out"
                rows.append(dataclasses.asdict(skipped))
            break
    return rows, meta
