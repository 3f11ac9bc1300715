"""Shared test helpers: implementations to parametrize over, random problem builders
for the packed / paged / kv-cache layouts, and the tolerance rule against the oracle.

Implementations (`IMPLEMENTATIONS`, used as ``@parametrize_impl``):

* ``xla``: the pure-jnp reference;
* ``triton``: the Pallas Triton kernels in interpret mode (runs on CPU);
* ``triton_gpu``: the same kernels compiled for an NVIDIA GPU, marked ``gpu``. The CPU
  command ``pytest -m "not gpu"`` deselects it; on the GPU machine run ``pytest -m gpu``.
  Nothing is skipped silently: without a GPU these tests fail.

Decode tests also run the Mosaic GPU decode kernel (`DECODE_MOSAIC_IMPLEMENTATIONS`):
``mosaic_gpu`` in Mosaic GPU interpret mode (on jax 0.10.2 the package adds what that
interpreter lacks and 0.11's has, `jax_paged_attn.kernels.common.mosaic_interpret_params`),
and ``mosaic_gpu_gpu`` compiled for a Hopper GPU, marked ``gpu``.

Varlen-only tests at 16-bit dtypes use ``@parametrize_varlen_impl``
(`VARLEN_IMPLEMENTATIONS`), which adds the Mosaic GPU prefill kernel: ``mosaic_gpu`` in
the Mosaic GPU interpreter (CPU) and ``mosaic_gpu_gpu`` compiled for a Hopper GPU
(marked ``gpu``). It takes no float32 queries (NotImplementedError), so the float32
tests do not list it.

Problems are built with NaN in every cache slot no sequence owns (unused pages, the tail
of a sequence's last page) and in padding rows of packed tensors, and with randomly
permuted block tables, so an implementation that reads padding shows NaN.

Tolerance (FlashAttention-3's rule): ``max|out - exact| <= RTOL * max|low - exact| + atol``,
where ``exact`` is the float64 oracle and ``low`` the oracle emulating the rounding a
flash-attention kernel does in the input dtype (`oracle` module docstring).

Hypothesis profiles: ``ci`` (default; derandomized, no example database, no deadline)
and ``explore`` (random, more examples): ``pytest --hypothesis-profile=explore``.

Full products (``--full``): the interpret-mode kernel grids and the ``xla`` path's
grids run, by default, a covering subset of their cases. A test marked
``@pytest.mark.covering`` keeps, per implementation, cases until every value of each
parameter (every pair of values, when three or more vary) appears in one
(`mark_outside_covering_subsets`); an API test's kernel case marked
``@pytest.mark.covered_by(impl, *node_ids)`` leaves its check to the kernel grids' named
cases (`mark_covered_by_kernel_grids` checks they run by default); a hand-made grid whose ids
name their features keeps cases until every feature appears in one (`covering_cases`).
The other cases carry the ``full`` marker: deselected on a CPU unless ``pytest --full``
is given, and always run in the GPU suite (``-m gpu``), where they compile.

``JPA_REPORT_FAILURES_AT_ONCE=1`` prints each failure's traceback when it happens, not
in the summary at the end, so a run stopped by a time limit still says why its
failures failed (`benchmarks/gpu_session.sh` sets it).
"""
from __future__ import annotations

import importlib.util
import os
from typing import Sequence

# The suite starts dozens of Python processes (pytest-xdist workers, servers and their
# engine processes, two-process cache tests, fresh-process checks), each importing jax,
# flax, torch and transformers. Where PYTHONDONTWRITEBYTECODE is set (the CI runs' host sets it)
# each of them compiled those packages' sources again: about a fifth of the suite's CPU
# time (2026-12-07, jax 0.10.2, 2 cores: 706 -> 557 s user CPU). Then the run keeps
# the bytecode it compiles in a private temporary folder of its own (PYTHONPYCACHEPREFIX:
# nothing is written beside the sources; a fresh folder, so no bytecode another user or
# run left is ever loaded), shared by its processes (they inherit the environment) and
# removed at its end. `_run_notes` says so (in the header, or at the end under -q).
import atexit
import shutil
import sys
import tempfile


def share_bytecode(environ: dict) -> str | None:
    """Where ``environ`` turns Python's bytecode cache off (PYTHONDONTWRITEBYTECODE set,
    no PYTHONPYCACHEPREFIX of the user's), turns it on in a fresh private folder
    (``tempfile.mkdtemp``: mode 0700) and returns the folder; else changes nothing and
    returns None."""
    if not environ.get("PYTHONDONTWRITEBYTECODE") or environ.get("PYTHONPYCACHEPREFIX"):
        return None
    folder = tempfile.mkdtemp(prefix="jax_paged_attn_tests_pycache_")
    environ["PYTHONPYCACHEPREFIX"] = folder
    del environ["PYTHONDONTWRITEBYTECODE"]
    return folder


BYTECODE_CACHE = share_bytecode(os.environ)
if BYTECODE_CACHE is not None:
    atexit.register(shutil.rmtree, BYTECODE_CACHE, ignore_errors=True)
    sys.pycache_prefix, sys.dont_write_bytecode = BYTECODE_CACHE, False  # (this process: read at each import)

# On a host without JAX's CUDA plugin the suite runs on the CPU, where most of its time is
# XLA compiling interpret-mode kernels and engine programs (each a fresh program); XLA's
# optimization level 0 compiles them in about 60 % of the time, and the tests time
# nothing. Set before JAX creates its CPU client; a level the user set is kept.
_CPU_HOST = not any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13))
if _CPU_HOST and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()


def _xla_knows_flags(flags: Sequence[str]) -> bool:
    """Whether this jaxlib's XLA takes every one of ``flags`` in XLA_FLAGS (an unknown flag
    aborts the process that parses them): asked of a child process, which parses them at
    once."""
    import subprocess
    import sys

    probe = ("import jaxlib._jax as xla\n"
             "options = xla.CompileOptions(); build = options.executable_build_options\n"
             "print(build.debug_options)\n")
    env = dict(os.environ, XLA_FLAGS=" ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip())
    try:
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and all(f"{flag.lstrip('-').split('=')[0]}: " in done.stdout for flag in flags)


# XLA:CPU flags that make the suite's many one-off programs (interpret-mode kernels,
# engine programs, references) quicker to compile on a CPU host, with the same IEEE
# operations:
# * its classic fusion emitters, not its MLIR ones (the default): 3-4x faster to compile;
#   the suite's CPU time dropped by about a third (2026-12, jax 0.10.2);
# * LLVM code generation in one piece (``split_count=1``), not split into 32 modules
#   compiled on XLA's thread pool: on a 2-core host that pool (NPROC threads, below) only
#   adds the splitting and the threads' hand-offs (tests/test_engine.py alone: XLA compile
#   time 37-45 -> 29 s, its CPU time 52-55 -> 43-45 s; 2026-12, jax 0.10.2).
# Set where this jaxlib knows them (asked once: pytest-xdist workers and the tests'
# subprocesses inherit XLA_FLAGS); a setting the user made is kept.
_CPU_COMPILE_FLAGS = ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")
if _CPU_HOST and os.environ.get("JPA_TEST_CPU_COMPILE_FLAGS") != "asked":
    _wanted = [flag for flag in _CPU_COMPILE_FLAGS
               if flag.lstrip("-").split("=")[0] not in os.environ.get("XLA_FLAGS", "")]
    if _wanted and not _xla_knows_flags(_wanted):  # one probe for all; one a flag where one is unknown
        _wanted = [flag for flag in _wanted if _xla_knows_flags([flag])]
    os.environ["XLA_FLAGS"] = " ".join([os.environ["XLA_FLAGS"], *_wanted])
    os.environ["JPA_TEST_CPU_COMPILE_FLAGS"] = "asked"  # the workers need not ask again
# The Mosaic GPU interpreter runs each warpgroup of a warp-specialized kernel as a thread
# whose barrier waits block inside callbacks that XLA's CPU client runs on its worker
# pool, one thread a core by default: on a 2-core host two blocked warpgroups left the
# others no thread, and a kernel with a producer and two or three compute warpgroups hung
# (2026-12). XLA sizes that pool by NPROC where it is set; 16 threads leave every
# warpgroup of a program one. Set before JAX creates its CPU client; a value the user
# set is kept.
if _CPU_HOST:
    os.environ.setdefault("NPROC", "16")

import dataclasses
import functools
import gc
import itertools
from typing import Any

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_paged_attn
import oracle

def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true",
                     help="also run the cases marked `full`: the whole parameter products of the interpret-mode "
                          "kernel grids (by default a covering subset runs)")


def _axis_value(value: Any) -> str:
    return value.name if isinstance(value, Implementation) else repr(value)


def mark_outside_covering_subsets(items: list[pytest.Item]) -> None:
    """Marks ``full`` the cases of each ``@pytest.mark.covering`` test that a covering
    subset of its parameter product leaves out.

    Per test and implementation (the ``impl`` parameter: every kernel, and the ``xla``
    path, keeps its own cases; ``gpu`` cases are all kept), the subset takes cases
    greedily in collection order until every value of each other parameter appears in one,
    and, when three or more parameters vary, every pair of values (unless the mark says
    ``covering(pairs=False)``: each value once, for parameters whose values exercise
    separate parts of a kernel)."""
    groups: dict[tuple, list[pytest.Item]] = {}
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", None)
        if not params or not item.get_closest_marker("covering") or item.get_closest_marker("gpu"):
            continue
        impl = params.get("impl")  # compiled implementations run only in gpu cases, skipped above
        groups.setdefault((item.module.__name__, item.originalname, _axis_value(impl)), []).append(item)
    for group in groups.values():
        values = [{axis: _axis_value(v) for axis, v in item.callspec.params.items() if axis != "impl"}
                  for item in group]
        varying = sorted(a for a in values[0] if len({v.get(a) for v in values}) > 1)
        pairs = group[0].get_closest_marker("covering").kwargs.get("pairs", True)
        if len(varying) <= 2 or not pairs:
            covers = [{(a, v[a]) for a in varying} for v in values]
        else:
            covers = [set(itertools.combinations([(a, v[a]) for a in varying], 2)) for v in values]
        uncovered = set().union(*covers)
        kept = {0}  # a test with one case (no varying parameter) keeps it
        uncovered -= covers[0]
        while uncovered:
            best = max((i for i in range(len(group)) if i not in kept), key=lambda i: len(covers[i] & uncovered))
            kept.add(best)
            uncovered -= covers[best]
        for i, item in enumerate(group):
            if i not in kept and not item.get_closest_marker("full"):
                item.add_marker(pytest.mark.full)


def mark_covered_by_kernel_grids(items: list[pytest.Item]) -> None:
    """Marks ``full`` the CPU cases of implementation ``impl`` of a test marked
    ``@pytest.mark.covered_by(impl, *node_ids)``: the kernel grids' cases ``node_ids`` check
    the same kernel on the same feature. Each named case must exist and run by default
    (checked whenever its file is collected)."""
    default = {item.nodeid for item in items if not item.get_closest_marker("full")}
    collected_files = {item.nodeid.split("::", 1)[0] for item in items}
    missing = []
    for item in items:
        impl = getattr(getattr(item, "callspec", None), "params", {}).get("impl")
        if not isinstance(impl, Implementation) or not impl.interpret or item.get_closest_marker("gpu"):
            continue
        for mark in item.iter_markers("covered_by"):
            impl_name, *node_ids = mark.args
            if impl.name != impl_name:
                continue
            item.add_marker(pytest.mark.full)
            missing += [f"{item.nodeid}: {n}" for n in node_ids
                        if n.split("::", 1)[0] in collected_files and n not in default]
    if missing:
        raise pytest.UsageError("covered_by names cases that do not run by default:\n" + "\n".join(missing))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the cases outside the covering subsets ``full``; without ``--full``, deselects
    the ``full`` cases that run on the CPU (a ``gpu`` case always runs: on the GPU the
    whole products are cheap)."""
    mark_outside_covering_subsets(items)
    mark_covered_by_kernel_grids(items)
    # The modules whose tests share a costly module fixture, each run by one worker
    # (xdist_group), start first: a whole group handed out late would be the run's tail.
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)
    if config.getoption("--full"):
        return
    dropped = [item for item in items if item.get_closest_marker("full") and not item.get_closest_marker("gpu")]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        dropped_ids = {id(item) for item in dropped}
        items[:] = [item for item in items if id(item) not in dropped_ids]


def covering_cases(cases: Sequence[Any], *, id_of: Any = str, keep: Sequence[str] = ()) -> list[Any]:
    """``cases`` (a hand-made grid whose ids name their features, ``"paged-bs32-gqa4-d64"``)
    as `pytest.param` s, those outside a covering subset marked ``full``.

    The subset holds every feature (each ``-``-separated word of an id) of the cases that
    run on a CPU in at least one of them: a greedy set cover in the grid's order, plus the
    ids ``keep`` names. A case already a `pytest.param` keeps its id and marks; a ``gpu``
    case is left as it is (it runs, and only, on the GPU).
    """
    def unwrap(case: Any) -> tuple[tuple, str | None, tuple]:
        if isinstance(case, type(pytest.param(None))):
            return case.values, case.id, tuple(case.marks)
        return (case,), None, ()

    entries = [unwrap(c) for c in cases]
    names = [i if i is not None else id_of(v[0] if len(v) == 1 else v) for v, i, _ in entries]
    features = [set(n.split("-")) for n in names]
    kept = {i for i, (n, (_, _, marks)) in enumerate(zip(names, entries))
            if n in keep or any(getattr(m, "name", None) == "gpu" for m in marks)}
    on_gpu_only = set(kept) - {i for i, n in enumerate(names) if n in keep}
    uncovered = (set().union(set(), *(f for i, f in enumerate(features) if i not in on_gpu_only))
                 - set().union(set(), *(features[i] for i in kept - on_gpu_only)))
    while uncovered:
        best = max((i for i in range(len(names)) if i not in kept), key=lambda i: len(features[i] & uncovered))
        kept.add(best)
        uncovered -= features[best]
    return [pytest.param(*values, id=names[i], marks=marks if i in kept else (*marks, pytest.mark.full))
            for i, (values, _, marks) in enumerate(entries)]


# Python's cyclic collector walks every tracked object of the generations it collects, and
# a test process holds a large, long-lived heap (JAX, Flax, torch, transformers, the test
# modules, JAX's caches of traced and compiled programs) while each test allocates many
# short-lived objects (jaxprs, MLIR, interpreter state). Collected and frozen after
# collection and again after each test module (its module-scoped fixtures torn down
# first), the survivors leave later collections; a larger youngest generation makes those
# rarer. tests/test_engine.py, test_attention.py and test_llama.py in one process: 23 s of
# 138 s in the collector before, 4.5 s of 117 s after (2026-12, jax 0.10.2, one core).
gc.set_threshold(50_000, 20, 10)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Collects what importing the test modules left, then freezes the heap (above)."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(trylast=True)  # after the runner's teardown, which finalizes the module's fixtures
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """At the end of a test module: collects its garbage, then freezes what survives.

    After a pytest-xdist worker's last test this also keeps its exit quick: the worker
    reports that it finished, the controller closes its gateway, and execnet sends the
    worker a SIGINT if it is still running 5 s later. pytest's own unconfigure runs full
    ``gc.collect()`` s, which over the unfrozen heap of a long run took longer than that on
    a loaded machine: the KeyboardInterrupt then landed in the first Python code after the
    collection (hypothesis's gc callback) and ended a green run with a
    PytestUnraisableExceptionWarning traceback. With the heap frozen here they have next to
    nothing to walk."""
    if nextitem is None or nextitem.module is not item.module:
        gc.collect()
        gc.freeze()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``JPA_REPORT_FAILURES_AT_ONCE`` set: a failure's traceback, printed at once
    (under pytest-xdist the controller receives every worker's reports)."""
    if report.failed and os.environ.get("JPA_REPORT_FAILURES_AT_ONCE") and not os.environ.get("PYTEST_XDIST_WORKER"):
        sys.stderr.write(f"\n--- FAILED {report.nodeid} ({report.when}):\n{report.longreprtext[-4000:]}\n---\n")
        sys.stderr.flush()


SERVING_TEST_PACKAGES = ("fastapi", "uvicorn", "jinja2", "openai")
"""What tests/test_serve.py needs: the ``serve`` extra and the openai client, both in the
``test`` extra (CI has them); a GPU host's image may lack them."""
_missing_serving_packages = [name for name in SERVING_TEST_PACKAGES if importlib.util.find_spec(name) is None]
collect_ignore = ["test_serve.py"] if _missing_serving_packages else []


def _run_notes() -> list[str]:
    """What the run chose for the user: where the suite's processes keep their bytecode when
    the environment turned Python's bytecode cache off, and that the server's tests are not
    collected here and why."""
    lines = []
    if BYTECODE_CACHE is not None:
        lines.append(f"PYTHONDONTWRITEBYTECODE is set: the suite's processes share their compiled bytecode "
                     f"under {BYTECODE_CACHE} (PYTHONPYCACHEPREFIX; nothing written beside the sources)")
    if _missing_serving_packages:
        lines.append(f"tests/test_serve.py not collected: {', '.join(_missing_serving_packages)} not installed "
                     f"(python3 -m pip install '.[test]')")
    return lines


def pytest_report_header(config: pytest.Config) -> list[str]:
    """`_run_notes`, at the top of the run."""
    return _run_notes()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """`_run_notes` at the end where ``-q`` hid the header (README's command): said once either way."""
    if config.get_verbosity() < 0:
        for line in _run_notes():
            terminalreporter.write_line(line)


hypothesis.settings.register_profile("ci", deadline=None, derandomize=True, database=None,
                                     print_blob=True)
hypothesis.settings.register_profile("explore", deadline=None, max_examples=200)
hypothesis.settings.load_profile("ci")

# The engine keeps its programs in JAX's persistent compilation cache under ~/.cache
# unless the process turned the cache off. A test run neither writes the user's cache nor
# loads what an earlier run left there (a compilation a test counts would be a cache hit).
jax.config.update("jax_enable_compilation_cache", False)
# A tuning table the developer measured for their own GPU (`python3 -m jax_paged_attn.tune`,
# under ~/.cache) must not change what the tests expect; tests/test_tuner.py points it at
# folders of its own.
os.environ["JAX_PAGED_ATTN_TUNING_DIR"] = "off"


# --------------------------------------------------------------------------- implementations


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One way to run the public functions: their ``implementation=`` / ``interpret=`` args."""

    name: str
    interpret: bool
    max_examples: int  # hypothesis examples per property test (interpret mode is slow)

    def api_kwargs(self) -> dict[str, Any]:
        return {"implementation": self.name, "interpret": self.interpret}


XLA = Implementation("xla", interpret=False, max_examples=8)
TRITON_INTERPRET = Implementation("triton", interpret=True, max_examples=4)
TRITON_GPU = Implementation("triton", interpret=False, max_examples=40)

IMPLEMENTATIONS = [
    pytest.param(XLA, id="xla"),
    pytest.param(TRITON_INTERPRET, id="triton"),
    pytest.param(TRITON_GPU, id="triton_gpu", marks=pytest.mark.gpu),
]
parametrize_impl = pytest.mark.parametrize("impl", IMPLEMENTATIONS)

MOSAIC_GPU_INTERPRET = Implementation("mosaic_gpu", interpret=True, max_examples=4)
MOSAIC_GPU_COMPILED = Implementation("mosaic_gpu", interpret=False, max_examples=40)
DECODE_MOSAIC_IMPLEMENTATIONS = [
    pytest.param(MOSAIC_GPU_INTERPRET, id="mosaic_gpu"),
    pytest.param(MOSAIC_GPU_COMPILED, id="mosaic_gpu_gpu", marks=pytest.mark.gpu),
]
"""The Mosaic GPU decode kernel (`jax_paged_attn.kernels.mosaic_decode`), for the decode tests."""
MOSAIC_INTERPRET, MOSAIC_GPU = MOSAIC_GPU_INTERPRET, MOSAIC_GPU_COMPILED
MOSAIC_IMPLEMENTATIONS = DECODE_MOSAIC_IMPLEMENTATIONS
VARLEN_IMPLEMENTATIONS = IMPLEMENTATIONS + MOSAIC_IMPLEMENTATIONS
parametrize_varlen_impl = pytest.mark.parametrize("impl", VARLEN_IMPLEMENTATIONS)
"""The varlen tests at 16-bit dtypes: every implementation, the Mosaic GPU prefill kernel too."""


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


# --------------------------------------------------------------------------- tolerances

RTOL = 2.0
"""A kernel may be this many times further from the oracle than the low-precision reference."""

ATOL = {
    jnp.dtype(jnp.float32): 2e-5,
    jnp.dtype(jnp.float16): 2e-4,
    jnp.dtype(jnp.bfloat16): 2e-3,
}
"""Floor of the tolerance: for float16 / bfloat16 about twice the rounding of a value near
0.3 (FA3's ``fwd_atol``); for float32 room for summation-order noise over a few hundred terms."""

# float32 keeps its tight floor on a GPU too: the kernels ask for IEEE float32 dots
# (Precision.HIGHEST), not TF32, and these tests hold them to it.


def tolerance(q_dtype: Any, low_precision_error: float) -> float:
    return RTOL * low_precision_error + ATOL[jnp.dtype(q_dtype)]


def assert_valid_output(out: jax.Array, q: jax.Array) -> None:
    """Output has q's shape and dtype and is finite (NaN padding never leaks)."""
    assert out.shape == q.shape, (out.shape, q.shape)
    assert out.dtype == q.dtype, (out.dtype, q.dtype)
    values = np.asarray(out.astype(jnp.float32))
    bad = np.argwhere(~np.isfinite(values))
    assert bad.size == 0, f"non-finite output at (row, head, dim) {bad[:5].tolist()} ..."


def assert_close_to_oracle(out: jax.Array, exact: np.ndarray, low: np.ndarray, q_dtype: Any) -> None:
    """FA3-style check of `out` against the float64 oracle (`exact`) and its emulation (`low`)."""
    got = np.asarray(out.astype(jnp.float32)).astype(np.float64)
    error = np.abs(got - exact)
    low_precision_error = float(np.max(np.abs(low - exact), initial=0.0))
    allowed = tolerance(q_dtype, low_precision_error)
    worst = float(np.max(error, initial=0.0))
    if worst > allowed:
        where = np.unravel_index(np.argmax(error), error.shape)
        raise AssertionError(
            f"max |out - oracle| = {worst:.3g} at {tuple(int(i) for i in where)} "
            f"(out {got[where]:.6g}, oracle {exact[where]:.6g}) exceeds {allowed:.3g} = "
            f"{RTOL} * {low_precision_error:.3g} (low-precision reference) + atol"
        )


def assert_nonfinite_rows_match_oracle(out: jax.Array, exact: np.ndarray, low: np.ndarray,
                                       q_dtype: Any) -> None:
    """`out` is non-finite in exactly the (token, head) rows where the oracle is, in every
    channel of such a row, and close to the oracle elsewhere (a non-finite K / V makes
    the whole row of every query that sees it NaN, and reaches no other row).

    NaN versus inf is left open (the kernels give NaN; a row of inf would do).
    """
    got = np.asarray(out.astype(jnp.float32)).astype(np.float64)
    bad_out = ~np.isfinite(got).all(axis=-1)
    bad_exact = ~np.isfinite(exact).all(axis=-1)
    leaked = np.argwhere(bad_out & ~bad_exact)
    assert leaked.size == 0, f"non-finite output in rows (row, head) {leaked[:8].tolist()} that see no non-finite key"
    lost = np.argwhere(bad_exact & ~bad_out)
    assert lost.size == 0, f"finite output in rows (row, head) {lost[:8].tolist()} that see a non-finite key"
    partly = np.argwhere(bad_out & np.isfinite(got).any(axis=-1))
    assert partly.size == 0, f"rows (row, head) {partly[:8].tolist()} are non-finite in some channels only"
    clean = lambda x: np.where(bad_exact[..., None], 0.0, x)
    assert_close_to_oracle(jnp.asarray(clean(got), jnp.float32), clean(exact), clean(low), q_dtype)


# --------------------------------------------------------------------------- calling the API

CPU_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}
"""XLA:CPU compiles each test case about twice as fast at LLVM level 0 (compile time
dominates these tiny cases); the generated code computes the same IEEE operations."""


def compile_and_call(fn: Any, static: dict[str, Any], arrays: dict[str, Any]) -> Any:
    """``jax.jit(partial(fn, **static))(**arrays)``, with `CPU_COMPILER_OPTIONS` on a CPU backend."""
    lowered = jax.jit(functools.partial(fn, **static)).lower(**arrays)
    options = CPU_COMPILER_OPTIONS if jax.default_backend() == "cpu" else None
    return lowered.compile(options)(**arrays)


def call_api(fn: Any, arrays: dict[str, Any], static: dict[str, Any], *, eager: bool,
             **attention: Any) -> jax.Array:
    """Calls a public function with `arrays` (traced unless eager) and static `attention` options.

    ``alibi_slopes`` is an array, so it travels with the arrays.
    """
    arrays = dict(arrays, alibi_slopes=attention.pop("alibi_slopes", None))
    if eager:
        return fn(**arrays, **static, **attention)
    return compile_and_call(fn, dict(static, **attention), arrays)


# --------------------------------------------------------------------------- problem builders


def random_array(rng: np.random.Generator, shape: Sequence[int], dtype: Any, scale: float = 1.0) -> jax.Array:
    return jnp.asarray(scale * rng.standard_normal(shape).astype(np.float32), dtype)


def alibi_slopes(num_heads: int) -> jax.Array:
    """The ALiBi paper's slopes ``2^(-8 (h + 1) / H)`` (f32 ``[H]``)."""
    return jnp.asarray([2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)], jnp.float32)


def cumulative(lengths: Sequence[int]) -> jax.Array:
    return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


@dataclasses.dataclass
class PagedCache:
    """A paged K/V cache ``[num_blocks, block_size, Hk, D]`` and its block table."""

    k: jax.Array
    v: jax.Array
    block_table: jax.Array  # i32[B, max_blocks_per_seq]


def build_paged_cache(
    rng: np.random.Generator,
    k_lens: Sequence[int],
    *,
    num_kv_heads: int,
    head_size: int,
    dtype: Any,
    block_size: int,
    cache_dtype: Any | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    extra_blocks: int = 2,
    max_blocks_per_seq: int | None = None,
) -> PagedCache:
    """Random tokens for each sequence, scattered over randomly permuted pages.

    Every slot no sequence owns is NaN; block-table entries past a sequence's last page
    hold random (valid) block ids, so reading them shows up as NaN or wrong values.
    fp8 caches (``cache_dtype``) hold ``x / scale`` of random x.
    """
    pages_per_seq = [-(-n // block_size) for n in k_lens]
    width = max_blocks_per_seq or max(1, max(pages_per_seq))
    num_blocks = sum(pages_per_seq) + extra_blocks
    page_ids = rng.permutation(num_blocks)
    block_table = rng.integers(0, num_blocks, size=(len(k_lens), width))
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_values = np.full(shape, np.nan, np.float32)
    v_values = np.full(shape, np.nan, np.float32)
    next_page = 0
    for b, (length, pages) in enumerate(zip(k_lens, pages_per_seq)):
        block_table[b, :pages] = page_ids[next_page:next_page + pages]
        next_page += pages
        for j in range(length):
            page, slot = block_table[b, j // block_size], j % block_size
            k_values[page, slot] = rng.standard_normal((num_kv_heads, head_size))
            v_values[page, slot] = rng.standard_normal((num_kv_heads, head_size))
    if cache_dtype is not None:
        k_cache = jnp.asarray(k_values / k_scale).astype(cache_dtype)
        v_cache = jnp.asarray(v_values / v_scale).astype(cache_dtype)
    else:
        k_cache, v_cache = jnp.asarray(k_values, dtype), jnp.asarray(v_values, dtype)
    return PagedCache(k_cache, v_cache, jnp.asarray(block_table, jnp.int32))


@dataclasses.dataclass
class VarlenProblem:
    """Arguments of `flash_attn_varlen_func` (packed, or paged when block_table is set)."""

    q: jax.Array  # [Tq, Hq, D]
    k: jax.Array  # [Tk, Hk, D] or [num_blocks, block_size, Hk, D]
    v: jax.Array
    cu_seqlens_q: jax.Array  # i32[B + 1]
    cu_seqlens_k: jax.Array  # i32[B + 1]
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: jax.Array | None = None
    seqused_k: jax.Array | None = None
    k_scale: Any = 1.0
    v_scale: Any = 1.0

    def arrays(self) -> dict[str, Any]:
        """The array arguments (traceable under jit), by keyword."""
        return dict(q=self.q, k=self.k, v=self.v, cu_seqlens_q=self.cu_seqlens_q,
                    cu_seqlens_k=self.cu_seqlens_k, block_table=self.block_table,
                    seqused_k=self.seqused_k, k_scale=self.k_scale, v_scale=self.v_scale)

    def run(self, impl: Implementation, *, eager: bool = False, **attention: Any) -> jax.Array:
        """Calls the API under jit (``eager=False``) or op by op; attention options are static."""
        static = dict(max_seqlen_q=self.max_seqlen_q, max_seqlen_k=self.max_seqlen_k,
                      **impl.api_kwargs())
        return call_api(jax_paged_attn.flash_attn_varlen_func, self.arrays(), static, eager=eager,
                        **attention)

    def oracle(self, emulate_dtype: Any | None = None, **attention: Any) -> np.ndarray:
        return oracle.varlen_attention(**self.arrays(), **attention, emulate_dtype=emulate_dtype)


@dataclasses.dataclass
class KVCacheProblem:
    """Arguments of `flash_attn_with_kvcache`."""

    q: jax.Array  # [B, Sq, Hq, D]
    k_cache: jax.Array  # [num_blocks, block_size, Hk, D]
    v_cache: jax.Array
    cache_seqlens: jax.Array  # i32[B]
    block_table: jax.Array  # i32[B, max_blocks_per_seq]
    k_scale: Any = 1.0
    v_scale: Any = 1.0

    def arrays(self) -> dict[str, Any]:
        return dict(q=self.q, k_cache=self.k_cache, v_cache=self.v_cache,
                    cache_seqlens=self.cache_seqlens, block_table=self.block_table,
                    k_scale=self.k_scale, v_scale=self.v_scale)

    def run(self, impl: Implementation, *, eager: bool = False, **attention: Any) -> jax.Array:
        """Calls the API under jit (``eager=False``) or op by op; attention options are static."""
        return call_api(jax_paged_attn.flash_attn_with_kvcache, self.arrays(), impl.api_kwargs(),
                        eager=eager, **attention)

    def oracle(self, emulate_dtype: Any | None = None, **attention: Any) -> np.ndarray:
        return oracle.kvcache_attention(**self.arrays(), **attention, emulate_dtype=emulate_dtype)


def make_varlen_problem(
    rng: np.random.Generator,
    q_lens: Sequence[int],
    k_lens: Sequence[int] | None = None,
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 32,
    dtype: Any = jnp.bfloat16,
    paged: bool = False,
    block_size: int = 16,
    cache_dtype: Any | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    q_padding_rows: int = 0,
    k_padding_rows: int = 0,
    use_seqused_k: bool = False,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    extra_blocks: int = 2,
    max_blocks_per_seq: int | None = None,
) -> VarlenProblem:
    """A random varlen problem; ``k_lens`` defaults to ``q_lens`` (self-attention prefill).

    Packed: k / v ``[sum(k_lens) + k_padding_rows, Hk, D]``. Paged (``paged=True``): a
    `build_paged_cache` cache read through a block table, optionally fp8. Padding rows
    of q / k / v are NaN. With ``use_seqused_k`` the key counts come from ``seqused_k``
    and ``cu_seqlens_k`` claims 3 more keys per sequence (so it must be ignored).
    """
    k_lens = list(q_lens) if k_lens is None else list(k_lens)
    assert len(k_lens) == len(q_lens)
    if cache_dtype is not None:
        assert paged, "fp8 is for the paged cache"
    q = np.concatenate([
        rng.standard_normal((sum(q_lens), num_q_heads, head_size)).astype(np.float32),
        np.full((q_padding_rows, num_q_heads, head_size), np.nan, np.float32),
    ])
    if paged:
        cache = build_paged_cache(
            rng, k_lens, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype,
            block_size=block_size, cache_dtype=cache_dtype, k_scale=k_scale, v_scale=v_scale,
            extra_blocks=extra_blocks, max_blocks_per_seq=max_blocks_per_seq)
        k, v, block_table = cache.k, cache.v, cache.block_table
    else:
        def packed() -> jax.Array:
            rows = rng.standard_normal((sum(k_lens), num_kv_heads, head_size)).astype(np.float32)
            pad = np.full((k_padding_rows, num_kv_heads, head_size), np.nan, np.float32)
            return jnp.asarray(np.concatenate([rows, pad]), dtype)

        k, v, block_table = packed(), packed(), None
    claimed_k_lens = [n + 3 for n in k_lens] if use_seqused_k else k_lens
    return VarlenProblem(
        q=jnp.asarray(q, dtype), k=k, v=v,
        cu_seqlens_q=cumulative(q_lens), cu_seqlens_k=cumulative(claimed_k_lens),
        max_seqlen_q=max_seqlen_q or max(1, max(q_lens)),
        max_seqlen_k=max_seqlen_k or max(1, max(k_lens)),
        block_table=block_table,
        seqused_k=jnp.asarray(k_lens, jnp.int32) if use_seqused_k else None,
        k_scale=jnp.float32(k_scale), v_scale=jnp.float32(v_scale),
    )


def make_kvcache_problem(
    rng: np.random.Generator,
    cache_seqlens: Sequence[int],
    num_queries: int = 1,
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 32,
    dtype: Any = jnp.bfloat16,
    block_size: int = 16,
    cache_dtype: Any | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    extra_blocks: int = 2,
    max_blocks_per_seq: int | None = None,
) -> KVCacheProblem:
    """A random decode problem: ``num_queries`` new queries per sequence over its cache."""
    cache = build_paged_cache(
        rng, cache_seqlens, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype,
        block_size=block_size, cache_dtype=cache_dtype, k_scale=k_scale, v_scale=v_scale,
        extra_blocks=extra_blocks, max_blocks_per_seq=max_blocks_per_seq)
    return KVCacheProblem(
        q=random_array(rng, (len(cache_seqlens), num_queries, num_q_heads, head_size), dtype),
        k_cache=cache.k, v_cache=cache.v,
        cache_seqlens=jnp.asarray(cache_seqlens, jnp.int32), block_table=cache.block_table,
        k_scale=jnp.float32(k_scale), v_scale=jnp.float32(v_scale),
    )


def check_against_oracle(problem: VarlenProblem | KVCacheProblem, impl: Implementation, *,
                         eager: bool = False, **attention: Any) -> np.ndarray:
    """Runs `problem` through the public API (jitted unless eager) and checks it against the oracle.

    ``attention`` holds the keyword arguments shared by the API and the oracle
    (softmax_scale, causal, window_size, softcap, alibi_slopes). Returns the output
    as float64 for further checks.
    """
    out = problem.run(impl, eager=eager, **attention)
    assert_valid_output(out, problem.q)
    exact = problem.oracle(**attention)
    low = problem.oracle(emulate_dtype=jnp.dtype(problem.q.dtype), **attention)
    assert_close_to_oracle(out, exact, low, problem.q.dtype)
    return np.asarray(out.astype(jnp.float32)).astype(np.float64)


def poison_keys(problem: VarlenProblem | KVCacheProblem, poison: dict[int, list]) -> VarlenProblem | KVCacheProblem:
    """A copy of `problem` with ``value`` written at key ``pos`` of sequence ``b`` for
    each ``(pos, "k" | "v", value)`` of ``poison[b]`` (packed rows or cache slots): in
    every KV head and channel of that key, or, for ``(pos, "k" | "v", value, (kv_head,
    channel))``, in that one element only."""
    kvcache = isinstance(problem, KVCacheProblem)
    k_name, v_name = ("k_cache", "v_cache") if kvcache else ("k", "v")
    arrays = {"k": np.array(getattr(problem, k_name).astype(jnp.float32)),
              "v": np.array(getattr(problem, v_name).astype(jnp.float32))}
    table = None if getattr(problem, "block_table", None) is None else np.asarray(problem.block_table)
    for b, entries in poison.items():
        for pos, which, value, *element in entries:
            where = (slice(None), slice(None)) if not element else tuple(element[0])
            if table is None:
                arrays[which][(int(problem.cu_seqlens_k[b]) + pos, *where)] = value
            else:
                block_size = arrays[which].shape[1]
                arrays[which][(table[b, pos // block_size], pos % block_size, *where)] = value
    dtype = getattr(problem, k_name).dtype
    return dataclasses.replace(problem, **{k_name: jnp.asarray(arrays["k"], dtype),
                                           v_name: jnp.asarray(arrays["v"], dtype)})


# --------------------------------------------------------------------------- engine tests

ENGINE_GROUP = pytest.mark.xdist_group("engine")
"""The modules whose engines run the tiny Llama (`engine_base`'s configs): one
pytest-xdist worker runs them all, so each compiled program of a model structure
(`LLMEngine` keeps one jitted set per structure, shared by every engine in the process)
is compiled once, not once in each worker a test of it lands on (about half their
time in the CPU suite)."""


def engine_base():
    """The `EngineConfig` the engine tests start from: tiny caches, fast CPU compiles, one
    bucket per count and static bounds at bucket capacity, so every engine built from it
    runs few programs (prefill only, mixed, decode only), shared between tests."""
    from jax_paged_attn.engine import EngineConfig

    return EngineConfig(num_blocks=24, block_size=16, max_num_seqs=4, max_num_batched_tokens=32,
                        num_host_blocks=32, batch_buckets=(4,), token_buckets=(32,),
                        block_table_width_buckets=(16,), coarse_length_bounds=True,
                        compiler_options={"xla_backend_optimization_level": 0})


class CompileCounter:
    """Counts XLA compilations while active, with JAX's own events (one
    ``backend_compile_duration`` per compilation or persistent-cache load), not a
    counter of the package's."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self) -> None:
        import jax

        self.count, self.active = 0, False
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration_s: float, **kwargs: Any) -> None:
        if self.active and event == self.EVENT:
            self.count += 1

    def __enter__(self) -> "CompileCounter":
        self.count, self.active = 0, True
        return self

    def __exit__(self, *exc: Any) -> None:
        self.active = False


def random_prompts(seed: int, lengths: Sequence[int]) -> list[list[int]]:
    """Prompts of these lengths with ids in the tiny Llama's vocabulary."""
    from jax_paged_attn.models import LlamaConfig

    rng = np.random.default_rng(seed)
    return [rng.integers(0, LlamaConfig.tiny().vocab_size, size=n).tolist() for n in lengths]


def cuda_lowering_target():
    """Context for tracing and lowering for CUDA on this host. From jax 0.11 the Pallas
    Triton lowering asks which GPU it lowers for, and a CPU host has none: the H200
    stands in (an abstract device, as the package's tuning plans for it on a CPU host).
    jax 0.10 does not ask. Trace inside the context too: the lowering reads the mesh the
    function was traced under."""
    import contextlib

    if jax.default_backend() != "cpu" or not hasattr(jax.sharding, "AbstractDevice"):
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    # A mesh of no axes: it names the device and shards nothing (with a 1-device axis,
    # jax 0.11.2's Mosaic GPU lowering fails on a scalar constant in the kernel).
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device))


def lower_for_cuda(fn: Any, *args: Any) -> str:
    """StableHLO text of ``jax.jit(fn)`` on ``args`` lowered for CUDA from this host
    (`cuda_lowering_target`)."""
    with cuda_lowering_target():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def profiled_trace_events(call: Any, profile_dir: Any) -> list[dict]:
    """Runs ``call(profile_dir)`` jitted, a Mosaic GPU kernel's call, without the profiler
    (``None``) and with it (``str(profile_dir)``, an empty folder); asserts the two outputs
    are equal and returns the events of the trace the profiled call wrote (GPU only)."""
    import json
    import pathlib

    plain = jax.jit(functools.partial(call, None))()
    profiled = jax.jit(functools.partial(call, str(profile_dir)))()
    jax.effects_barrier()
    np.testing.assert_array_equal(np.asarray(profiled, np.float32), np.asarray(plain, np.float32))
    (trace_file,) = pathlib.Path(profile_dir).glob("*trace.json")
    return json.loads(trace_file.read_text())["traceEvents"]


def count_in_calls(stablehlo_text: str, needle: str) -> int:
    """Occurrences of ``needle`` that ``@main`` of a StableHLO module reaches, counting a
    function's once per call (a kernel call is a jitted callee that the layers share:
    `jax_paged_attn.dispatch`, so its text stands once however many layers call it)."""
    import re

    bodies: dict[str, str] = {}
    for match in re.finditer(r'func\.func (?:public |private )?@("[^"]+"|[\w$.-]+)\(', stablehlo_text):
        end = stablehlo_text.find("func.func ", match.end())
        bodies[match.group(1)] = stablehlo_text[match.end():end if end >= 0 else len(stablehlo_text)]

    @functools.cache
    def count(name: str) -> int:
        body = bodies[name]
        callees = re.findall(r'call @("[^"]+"|[\w$.-]+)\(', body)
        return body.count(needle) + sum(count(callee) for callee in callees if callee in bodies)

    return count("main")


def assert_no_data_dependent_branch(stablehlo_text: str) -> None:
    """No ``stablehlo.if``, and every ``stablehlo.case`` branches on a constant index (or on
    a case over one): `lax.platform_dependent`'s kernel-or-reference choice, which XLA
    folds. Any other case would branch on data (XLA copies its predicate to the host)."""
    import re

    assert "stablehlo.if" not in stablehlo_text

    def constant(name: str) -> bool:
        if re.search(rf"{re.escape(name)} = stablehlo.constant", stablehlo_text):
            return True
        inner = re.search(rf'{re.escape(name)} = "stablehlo.case"\((%[\w#]+)\)', stablehlo_text)
        return bool(inner) and constant(inner.group(1))

    for index in re.findall(r'"stablehlo.case"\((%[\w#]+)\)', stablehlo_text):
        assert constant(index), index
