"""The package's layering: launch plans below both the wrappers and the kernels.

``spec``, ``kv_view`` and ``tuning`` import nothing of the package, ``reference`` only
the spec, ``plans`` only those, ``kernels.common`` and ``kernels.triton_offsets`` (the
lowering fix every Triton kernel relies on, installed by the ``kernels`` package) only
the plans; the kernels (``jax_paged_attn/kernels/*``) import only the spec, the plans,
``kv_view``, ``reference``'s helpers and ``kernels.common``, never a
wrapper (``prefill``, ``decode``, ``cache``), the public API, the layers or the
dispatch, nor another kernel. Imports are read with ``ast`` (function-level imports
included), so nothing is imported to check them.

The engine (``jax_paged_attn/engine/``) lives in rooms: every module is at most
`MAX_ENGINE_MODULE_LINES` lines, says in its docstring what it owns, is named in
``engine.py``'s docstring (the room table and the walk of `LLMEngine.step`), and sits
below `LLMEngine`: none imports ``engine.py`` but ``llm.py`` (built on it) and the
package's ``__init__``.

The benchmarks (``benchmarks/*.py``) are modules of one job each, at most
`MAX_BENCHMARK_MODULE_LINES` lines, each with a docstring and named in
benchmarks/README.md's layout table.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = "jax_paged_attn"
_ROOT = pathlib.Path(__file__).resolve().parents[1] / PACKAGE

WRAPPERS = tuple(f"{PACKAGE}.{name}" for name in ("prefill", "decode", "cache", "api", "layer", "dispatch", "matmul",
                                                   "norm"))

BOTTOM = {  # module -> the package modules it may import
    f"{PACKAGE}.spec": set(),
    f"{PACKAGE}.kv_view": set(),
    f"{PACKAGE}.tuning": set(),
    f"{PACKAGE}.reference": {f"{PACKAGE}.spec"},
    f"{PACKAGE}.plans": {f"{PACKAGE}.spec", f"{PACKAGE}.tuning"},
    f"{PACKAGE}.kernels.common": {f"{PACKAGE}.plans"},
    f"{PACKAGE}.kernels.triton_offsets": {f"{PACKAGE}.plans"},
    f"{PACKAGE}.kernels": {f"{PACKAGE}.kernels.triton_offsets"},  # the package installs the fix
}
KERNEL_HELPERS = ("__init__", "common", "triton_offsets")  # modules of kernels/ that are not kernels
KERNEL_IMPORTS = {f"{PACKAGE}.{name}" for name in ("spec", "plans", "kv_view", "reference", "kernels.common")}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    rel = pathlib.Path(*name.split("."))
    base = _ROOT.parent / rel
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def package_imports(source: str, importer: str, is_package: bool = False) -> set[str]:
    """The modules of the package that ``source`` (the text of module ``importer``)
    imports: ``from a import b`` counts as ``a.b`` when that is a module, else ``a``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importer's package
                anchor = importer.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if _is_module(candidate) else base)
    return {name for name in found if name == PACKAGE or name.startswith(PACKAGE + ".")}


def imports_of(module: str) -> set[str]:
    rel = pathlib.Path(*module.split(".")[1:])
    path = _ROOT / rel.with_suffix(".py")
    is_package = not path.is_file()
    if is_package:
        path = _ROOT / rel / "__init__.py"
    return package_imports(path.read_text(), module, is_package) - {module}


KERNEL_MODULES = sorted(module_name(p) for p in (_ROOT / "kernels").glob("*.py")
                        if p.stem not in KERNEL_HELPERS)


def test_the_kernels_are_found():
    assert {f"{PACKAGE}.kernels.triton_prefill", f"{PACKAGE}.kernels.triton_decode",
            f"{PACKAGE}.kernels.triton_cache"} <= set(KERNEL_MODULES)


@pytest.mark.parametrize("module", KERNEL_MODULES)
def test_no_kernel_imports_a_wrapper_or_another_kernel(module):
    imported = imports_of(module)
    assert not imported & set(WRAPPERS), f"{module} imports {sorted(imported & set(WRAPPERS))}"
    assert imported <= KERNEL_IMPORTS, f"{module} imports {sorted(imported - KERNEL_IMPORTS)}"


@pytest.mark.parametrize("module", sorted(BOTTOM))
def test_the_bottom_layers_import_no_kernel_or_wrapper(module):
    imported = imports_of(module)
    assert imported <= BOTTOM[module], f"{module} imports {sorted(imported - BOTTOM[module])}"


def test_the_wrappers_take_their_plans_from_plans():
    for wrapper in ("prefill", "decode", "cache"):
        assert f"{PACKAGE}.plans" in imports_of(f"{PACKAGE}.{wrapper}"), wrapper


def test_the_import_reader_sees_every_form():
    source = "\n".join([
        "from jax_paged_attn import prefill",
        "import jax_paged_attn.decode as d",
        "from jax_paged_attn.plans import TileField",
        "from .. import cache",
        "from ..spec import AttentionSpec",
        "from . import common",
        "def f():\n    from jax_paged_attn import dispatch",
        "import numpy as np",
    ])
    assert package_imports(source, f"{PACKAGE}.kernels.some_kernel") == {
        f"{PACKAGE}.prefill", f"{PACKAGE}.decode", f"{PACKAGE}.plans", f"{PACKAGE}.cache",
        f"{PACKAGE}.spec", f"{PACKAGE}.kernels.common", f"{PACKAGE}.dispatch",
    }


ENGINE_MODULES = sorted((_ROOT / "engine").glob("*.py"))
MAX_ENGINE_MODULE_LINES = 600


@pytest.mark.parametrize("path", ENGINE_MODULES, ids=lambda path: path.name)
def test_every_engine_room_is_small_and_says_what_it_owns(path):
    source = path.read_text()
    assert len(source.splitlines()) <= MAX_ENGINE_MODULE_LINES, f"{path.name}: split it into rooms"
    assert ast.get_docstring(ast.parse(source)), f"{path.name} has no module docstring"


def test_the_engine_names_every_room_and_no_room_imports_the_engine():
    engine_doc = ast.get_docstring(ast.parse((_ROOT / "engine" / "engine.py").read_text()))
    rooms = [path for path in ENGINE_MODULES if path.stem != "__init__"]
    assert len(rooms) > 10
    for path in rooms:
        assert f"``{path.name}``" in engine_doc, f"engine.py's docstring does not name {path.name}"
        if path.stem not in ("engine", "llm"):
            module = module_name(path)
            assert f"{PACKAGE}.engine.engine" not in imports_of(module), f"{module} imports the engine"


BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
BENCHMARK_MODULES = sorted(BENCHMARKS.glob("*.py"))
MAX_BENCHMARK_MODULE_LINES = 600


@pytest.mark.parametrize("path", BENCHMARK_MODULES, ids=lambda path: path.name)
def test_every_benchmark_module_is_small_and_says_what_it_owns(path):
    """The benchmarks are modules of one job each (the harness's shapes, peers, sweeps,
    timing, jobs and report; the scripts that compose them): none over
    `MAX_BENCHMARK_MODULE_LINES` lines, each with a docstring, each named in
    benchmarks/README.md."""
    source = path.read_text()
    assert len(source.splitlines()) <= MAX_BENCHMARK_MODULE_LINES, f"{path.name}: split it by job"
    assert ast.get_docstring(ast.parse(source)), f"{path.name} has no module docstring"
    assert f"`{path.name}`" in (BENCHMARKS / "README.md").read_text(), f"benchmarks/README.md does not name {path.name}"
