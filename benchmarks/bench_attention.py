#!/usr/bin/env python3
"""Benchmarks jax_paged_attn's kernels against their peers, in one run, on one GPU.

    python benchmarks/bench_attention.py [--suite decode,prefill,varlen,prefix,cache]
                                         [--tune] [--out DIR] [--quick]

Suites (bf16, vLLM cache layout, permuted block tables):

* ``decode``: one query token per sequence over a paged cache (page 16).
  GB/s = bytes of K and V to read (2 * B * ctx * Hk * D * itemsize) / time.
* ``prefill``: dense causal self-attention, B sequences of S tokens, packed.
  TFLOP/s = 4 * B * Hq * D * S^2 / 2 / time (flash-attention's benchmark convention).
* ``varlen``: causal self-attention over packed sequences of mixed lengths.
* ``prefix``: prefill of new tokens on a cached prefix, keys read from a paged cache.
  varlen / prefix TFLOP/s count the exact bottom-right causal work:
  4 * Hq * D * sum over sequences of the visible keys summed over queries.
* ``cache``: ``reshape_and_cache_flash`` under jit with donated caches.
  GB/s = (bytes of key + value read, bytes written to the caches, slot ids) / time.

Every implementation of a shape is credited with the same useful work, so the ratio
ours / peer printed next to each peer is the peer's time over ours; each output is
compared with ours. Each peer runs inside its own try/except: a failure is recorded
(with its message) and the run goes on. Each suite runs in its own process, so a job
that kills it (a CUDA fault poisons the context) costs that job, not the run
(``--no-isolate`` runs everything in this process). Results go to ``--out`` (default:
``benchmarks/results/``) as ``<date>-<device>.md`` and ``.json`` (``--stem`` names them),
rewritten after every suite; the committed ``benchmarks/RESULTS.md`` is written only
with ``--update-committed-md``.

``--tune`` instead sweeps our kernels' configs (`jax_paged_attn.tuning.DecodeConfig` /
`PrefillConfig`) on the selected suites (default decode,prefill), writes
``<date>-<device>-tuning.md`` and ``.json``, and prints dict literals ready to paste
into tuning.py's tables. The grids, the timing loop and the choice are the package's
(`jax_paged_attn.tune`, whose ``python3 -m jax_paged_attn.tune`` is the users' command).

Without a GPU the run stops at once with an error (exit code 2), unless ``--tiny`` or
``--interpret`` asks for a CPU dry run of the harness. It exits with 1 when no job
measured anything (every one failed or was skipped).

The run keeps to a time budget (``--budget-s``, compile time included, counted from the
start of `main`; ``inf`` for none): each suite gets a share of what is left, sweeps stop
early and late measurements are recorded as skipped when their share is spent.

This script is the command line that composes the harness's modules: the shapes
(`suites.py`), the implementations (`peers.py`, `prefill_peers.py`, `cache_peers.py`),
the swept configs (`sweeps.py`), the timing (`timing.py`), the jobs with their rounds and
child processes (`jobs.py`) and the report (`report.py`). It owns the options, the plan
of a run's jobs, the time budget's shares, the device probe and where the outputs go.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

# Run as a script from the repo root: make the working tree's jax_paged_attn and the
# sibling modules importable whatever the installed packages are.
_BENCH_DIR = pathlib.Path(__file__).resolve().parent
for _path in (_BENCH_DIR.parent, _BENCH_DIR):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import jax  # noqa: E402

import report  # noqa: E402
from cache_peers import CACHE_IMPLS  # noqa: E402
from jax_paged_attn import tuning  # noqa: E402
from jobs import REPLACES, Job, Row, run_jobs, run_suite_isolated  # noqa: E402
from peers import DECODE_IMPLS, Impl  # noqa: E402
from prefill_peers import PREFILL_IMPLS, PREFIX_IMPLS, VARLEN_IMPLS  # noqa: E402
from suites import DEFAULT_TUNE_SUITES, FULL_CASES, SUITE_TITLES, SUITES, TINY_CASES, TUNABLE_SUITES  # noqa: E402
from sweeps import tune_grid  # noqa: E402
from timing import Context, Deadline, Timer, short_error  # noqa: E402


# Share of the time budget per suite (of what is left when the suite starts).
SUITE_WEIGHTS = {"decode": 30, "prefill": 35, "varlen": 12, "prefix": 13, "cache": 10}
TUNE_WEIGHTS = {"decode": 45, "prefill": 40, "varlen": 8, "prefix": 7}
DEFAULT_BUDGET_S = 330.0


SUITE_IMPLS = {"decode": DECODE_IMPLS, "prefill": PREFILL_IMPLS, "varlen": VARLEN_IMPLS,
               "prefix": PREFIX_IMPLS, "cache": CACHE_IMPLS}


# =========================================================================== the run's jobs


def select_cases(suite: str, args: argparse.Namespace) -> tuple[Any, ...]:
    cases = TINY_CASES[suite] if args.tiny else FULL_CASES[suite]
    if args.shapes:
        cases = tuple(c for c in cases if any(text in c.label for text in args.shapes))
    return cases[:1] if args.quick else cases


def select_impls(suite: str, args: argparse.Namespace) -> tuple[Impl, ...]:
    impls = SUITE_IMPLS[suite]
    if args.peer_names is None:
        return impls
    return tuple(i for i in impls if i.is_ours or i.name in args.peer_names)


def plan_jobs(suite: str, args: argparse.Namespace) -> list[Job]:
    """The suite's jobs in run order (deterministic: a restarted process resumes by index).

    Benchmarks: implementations outer (ours first), shapes inner, so when the budget
    runs short the last peers are skipped on every shape alike. Tuning: configs
    outer, so a sweep cut short still has the same configs on every shape.
    """
    cases = select_cases(suite, args)
    if args.tune:
        return [Job(suite, case, config=config) for config in tune_grid(suite, cases, args.quick)
                for case in cases]
    return [Job(suite, case, impl=impl) for impl in select_impls(suite, args) for case in cases]


def run_timer(args: argparse.Namespace) -> Timer:
    """``--warmup`` / ``--reps``; a ``--tiny`` dry run times samples of one call (`Timer.dry_run`)."""
    return Timer(args.warmup, args.reps, min_calls=1 if args.tiny else Timer.min_calls)


def child_main(args: argparse.Namespace) -> int:
    """A suite's process: runs its jobs from ``--child-start`` on, one JSON line per row."""
    suite = args.suites[0]
    jobs = plan_jobs(suite, args)[args.child_start:]
    meta = device_meta()
    pathlib.Path(args.child_meta).write_text(json.dumps(meta))
    print(f"[{suite}] process {os.getpid()}: {meta['gpu']} | torch {meta['torch']} | jobs {args.child_start}.."
          f"{args.child_start + len(jobs) - 1}", flush=True)
    ctx = Context(run_timer(args), Deadline(args.child_deadline), ours_implementation=args.ours_impl,
                  rounds=args.rounds, interpret=args.interpret, quick=args.quick, max_configs=args.max_configs)
    with open(args.child_rows, "w") as sink:
        def emit(row: Row, replaces: int | None) -> None:
            record = dataclasses.asdict(row)
            if replaces is not None:
                record[REPLACES] = replaces
            sink.write(json.dumps(record, default=str) + "\n")
            sink.flush()

        run_jobs(jobs, ctx, emit)
    return 0


# =========================================================================== driver


def run_meta(argv: Sequence[str], args: argparse.Namespace, started: datetime.datetime) -> dict[str, Any]:
    """What the run was (no device touched: the parent of isolated suites must leave the GPU alone)."""
    notes = []
    if args.ours_impl != "triton":
        notes.append(f"ours ran with implementation={args.ours_impl!r}")
    if args.quick:
        notes.append("--quick: first shape of each suite, reduced sweeps")
    if args.tiny:
        notes.append("--tiny: toy shapes for a dry run; the numbers mean nothing")
    if args.rounds > 1 and not args.tune:
        notes.append(f"each time: the median of up to {args.rounds} alternating rounds of the suite's calls "
                     "(rounds_ms in the JSON; fewer where the suite's budget ran out)")
    return {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python", "benchmarks/bench_attention.py", *argv]),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "budget_s": args.budget_s,
        "notes": notes,
    }


def device_meta() -> dict[str, Any]:
    """GPU name and library versions (initializes the JAX backend)."""
    device = jax.devices()[0]
    meta: dict[str, Any] = {
        "gpu": f"{getattr(device, 'device_kind', device.platform)} ({device.platform}, {len(jax.devices())} device(s))",
    }
    try:
        import jaxlib

        meta["jaxlib"] = jaxlib.__version__
    except Exception:  # noqa: BLE001
        meta["jaxlib"] = "unknown"
    try:
        import torch

        meta["torch"] = f"{torch.__version__} (cuda available: {torch.cuda.is_available()})"
    except Exception as e:  # noqa: BLE001
        meta["torch"] = f"not importable ({short_error(e, 100)})"
    return meta


_PROBE = "import jax; d = jax.devices()[0]; print(d.platform); print(getattr(d, 'device_kind', d.platform))"
PROBE_TIMEOUT_S = 300.0


def probe_device(isolate: bool) -> tuple[str, str]:
    """(platform, device kind) of JAX's default device, e.g. ``("gpu", "NVIDIA H200")``.

    With isolated suites a short child process asks, so that this process never opens
    the GPU (JAX would hold its memory for the whole run); without isolation this
    process asks itself. A probe that fails reports ``("unknown", <why>)``.
    """
    if not isolate:
        device = jax.devices()[0]
        return device.platform, getattr(device, "device_kind", device.platform)
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")  # the probe only looks
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        return "unknown", f"the device probe timed out after {PROBE_TIMEOUT_S:.0f} s"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or len(lines) < 2:
        tail = " ".join(done.stderr.strip().splitlines()[-1:]) or f"exit code {done.returncode}"
        return "unknown", f"the device probe failed: {tail[:300]}"
    return lines[-2].strip(), lines[-1].strip()


def no_gpu_message(platform_name: str, device_kind: str) -> str | None:
    """Why this host cannot run the benchmarks, or None on a GPU."""
    if platform_name == "gpu":
        return None
    return (f"bench_attention.py: no GPU here (JAX's default device: {device_kind}, platform "
            f"{platform_name!r}). The benchmarks time the Pallas GPU kernels against GPU peers; run "
            f"them on an NVIDIA GPU host, or pass --tiny (toy shapes) or --interpret (Pallas "
            f"interpret mode) for a CPU dry run of the harness.")


def device_slug(device_kind: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia-h200"``: the device part of the output file names."""
    return tuning.device_slug(device_kind)


def output_paths(args: argparse.Namespace, device_kind: str, started: datetime.datetime) -> list[pathlib.Path]:
    """Markdown files the run writes (the JSON sits next to the first one).

    ``--out``/``<stem>.md`` with the stem ``<YYYY-MM-DD-HHMM>-<device>`` (``-tuning``
    appended for a sweep) unless ``--stem`` names it; plus the committed
    ``benchmarks/RESULTS.md`` (``TUNING.md`` for a sweep) only with
    ``--update-committed-md``.
    """
    stem = args.stem
    if stem is None:
        stem = f"{started.strftime('%Y-%m-%d-%H%M')}-{device_slug(device_kind)}"
        if args.tune:
            stem += "-tuning"
    paths = [pathlib.Path(args.out) / f"{stem}.md"]
    if args.update_committed_md:
        paths.append(_BENCH_DIR / ("TUNING.md" if args.tune else "RESULTS.md"))
    return paths


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", default=None,
                        help=f"comma-separated subset of {','.join(SUITES)} (default: all; with --tune: "
                             f"{','.join(DEFAULT_TUNE_SUITES)})")
    parser.add_argument("--tune", action="store_true", help="sweep our kernel configs instead of comparing peers")
    parser.add_argument("--out", default=str(_BENCH_DIR / "results"),
                        help="folder for the markdown and JSON (default: %(default)s)")
    parser.add_argument("--stem", default=None,
                        help="file name of the outputs without extension (default: <YYYY-MM-DD-HHMM>-<device>, "
                             "-tuning appended with --tune)")
    parser.add_argument("--update-committed-md", action="store_true",
                        help="also write the markdown to benchmarks/RESULTS.md (TUNING.md with --tune), the "
                             "committed copy; never done by default")
    parser.add_argument("--quick", action="store_true", help="first shape of each suite, smaller sweeps")
    parser.add_argument("--shapes", default=None, metavar="TEXT,...",
                        help="only the shapes whose label holds one of these texts (e.g. D64 or 'B256 ctx1024')")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help="wall-clock budget of the whole run from its start, compile included; inf for none "
                             "(default: %(default)s)")
    parser.add_argument("--max-configs", type=int, default=0,
                        help="a swept peer's first N configs only, the package default first (default: all)")
    parser.add_argument("--reps", type=int, default=10, help="timed calls per measurement (median; default 10)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="times every measured call in this many alternating rounds, all of a suite's calls "
                             "per round, while its budget lasts; a row's time is the median (default 3; "
                             "with --tune, 1)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first, the first compiles (default 3)")
    parser.add_argument("--peers", default=None,
                        help="comma-separated implementation names to run besides ours (default: all)")
    parser.add_argument("--ours-impl", default="triton", choices=("triton", "xla", "auto"),
                        help="implementation= passed to our public API (default: triton)")
    parser.add_argument("--tiny", action="store_true", help="toy shapes: a CPU dry run of the harness")
    parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode for our kernels (CPU)")
    parser.add_argument("--no-isolate", dest="isolate", action="store_false",
                        help="run every suite in this process (default: one child process per suite, so a "
                             "CUDA fault loses one job, not the run)")
    for hidden in ("--child-rows", "--child-meta"):
        parser.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-start", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--child-deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    default_suites = DEFAULT_TUNE_SUITES if args.tune else SUITES
    args.suites = tuple(s for s in (args.suite.split(",") if args.suite else default_suites) if s)
    allowed = TUNABLE_SUITES if args.tune else SUITES
    unknown = [s for s in args.suites if s not in allowed]
    if unknown:
        parser.error(f"unknown suite(s) {unknown} for {'--tune' if args.tune else 'a benchmark run'}; "
                     f"choose from {','.join(allowed)}")
    if args.reps < 1 or args.warmup < 1:
        parser.error("--reps and --warmup must be >= 1")
    if args.max_configs < 0:
        parser.error(f"--max-configs must be >= 0 (0: every config), got {args.max_configs}")
    if not args.budget_s > 0:  # also rejects nan
        parser.error(f"--budget-s must be > 0 (inf for no budget), got {args.budget_s}")
    if args.stem is not None and (not args.stem or "/" in args.stem or args.stem.startswith(".")):
        parser.error(f"--stem must be a plain file name, got {args.stem!r}")
    args.peer_names = None if args.peers is None else {p for p in args.peers.split(",") if p}
    args.shapes = [t for t in args.shapes.split(",") if t] if args.shapes else []
    known = {impl.name for suite in args.suites for impl in SUITE_IMPLS.get(suite, ())}
    # (A suite's child process gets the run's peers, some of them other suites': the
    # parent checked them against every suite of the run.)
    if args.peer_names and args.peer_names - known and args.child_rows is None:
        parser.error(f"unknown peer(s) {sorted(args.peer_names - known)} for suites {','.join(args.suites)}; "
                     f"known: {','.join(sorted(known))}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    # What a suite's child process must get to plan the same jobs and time them alike.
    args.forwarded = [flag for flag, on in (("--tune", args.tune), ("--quick", args.quick), ("--tiny", args.tiny),
                                            ("--interpret", args.interpret)) if on]
    args.forwarded += ["--reps", str(args.reps), "--rounds", str(args.rounds), "--warmup", str(args.warmup),
                       "--ours-impl", args.ours_impl,
                       "--max-configs", str(args.max_configs)]
    if args.peers is not None:
        args.forwarded += ["--peers", args.peers]
    if args.shapes:
        args.forwarded += ["--shapes", ",".join(args.shapes)]
    return args


def suite_deadline(suite: str, remaining: Sequence[str], weights: dict[str, float], end: float) -> Deadline:
    """The suite's share of the time left, in proportion to the weights of the suites left."""
    now = time.monotonic()
    if math.isinf(end):
        return Deadline(end)
    share = weights[suite] / sum(weights[s] for s in remaining)
    return Deadline(now + max(0.0, end - now) * share)


def write_outputs(paths: Sequence[pathlib.Path], meta: dict[str, Any], rows: list[dict[str, Any]],
                  args: argparse.Namespace, start: float) -> str:
    """Writes the markdown to every path in ``paths`` and the JSON of raw rows next to the
    first one (same stem, ``.json``); returns the markdown. ``start``: `time.monotonic`
    at the start of the run."""
    meta = dict(meta, elapsed_s=round(time.monotonic() - start, 1))
    if args.tune:
        markdown = report.render_tuning(meta, rows)
    else:
        report.attach_ratios(rows)
        legends = {s: {i.name: i.describe for i in SUITE_IMPLS[s]} for s in SUITES}
        titles = [(s, SUITE_TITLES[s]) for s in args.suites]
        markdown = report.render_results(meta, rows, titles, legends)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(markdown)
    with open(paths[0].with_suffix(".json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    return markdown


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmarks (see the module docstring); returns the exit code: 0 when some
    job measured something, 1 when none did, 2 without a GPU (unless a dry run)."""
    start = time.monotonic()  # the budget counts from here, however long ago the module was imported
    started = datetime.datetime.now(datetime.timezone.utc)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child_rows:
        return child_main(args)
    platform_name, device_kind = probe_device(args.isolate)
    refusal = no_gpu_message(platform_name, device_kind)
    if refusal and not (args.tiny or args.interpret):
        print(refusal, file=sys.stderr, flush=True)
        return 2
    end = start + args.budget_s
    weights = TUNE_WEIGHTS if args.tune else SUITE_WEIGHTS
    meta = run_meta(argv, args, started)
    if not args.isolate:
        meta.update(device_meta())
        print(f"{meta['gpu']} | jax {meta['jax']} | torch {meta['torch']}", flush=True)
    else:
        # This process only plans and collects: keep it off the GPU, whose memory the
        # suites' processes need (JAX preallocates most of it in the first to touch it).
        jax.config.update("jax_platforms", "cpu")
    paths = output_paths(args, device_kind, started)
    rows: list[dict[str, Any]] = []
    markdown = ""
    with tempfile.TemporaryDirectory(prefix="bench_attention_") as workdir:
        for index, suite in enumerate(args.suites):
            deadline = suite_deadline(suite, args.suites[index:], weights, end)
            jobs = plan_jobs(suite, args)
            print(f"== {suite}: {len(jobs)} job(s), {deadline.end - time.monotonic():.0f} s budget", flush=True)
            if args.isolate:
                suite_rows, child_meta = run_suite_isolated(suite, jobs, args, deadline, pathlib.Path(workdir))
                meta = {**child_meta, **meta} if child_meta else meta
            else:
                suite_rows = []
                ctx = Context(run_timer(args), deadline, ours_implementation=args.ours_impl, rounds=args.rounds,
                              interpret=args.interpret, quick=args.quick, max_configs=args.max_configs)
                def emit(row: Row, replaces: int | None) -> None:
                    if replaces is None:
                        suite_rows.append(dataclasses.asdict(row))
                    else:
                        suite_rows[replaces] = dataclasses.asdict(row)

                run_jobs(jobs, ctx, emit)
            rows += suite_rows
            markdown = write_outputs(paths, meta, rows, args, start)
    print()
    if args.tune:
        print(markdown)
    else:  # the full tables are in the file; keep the terminal's tail readable
        print(report.render_summary(rows, [(s, SUITE_TITLES[s]) for s in args.suites]))
    print(f"wrote {', '.join(str(p) for p in paths)} and {paths[0].with_suffix('.json').name} "
          f"({time.monotonic() - start:.0f} s)", flush=True)
    measured = sum(row["status"] == "ok" for row in rows)
    if measured == 0:
        counts = {status: sum(row["status"] == status for row in rows) for status in ("failed", "skipped")}
        print(f"no job measured anything ({counts['failed']} failed, {counts['skipped']} skipped): see "
              f"'Not measured' in {paths[0]}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
