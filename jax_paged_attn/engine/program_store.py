"""Compiled engine programs kept on disk, so that a second start loads them instead of
tracing, lowering and compiling them again.

JAX's persistent compilation cache keys a program by its lowered module, so a warm
start still traces and lowers every program (about 1.5 s each for a 16-layer model's
decode window on a 2-core CPU host) before the cache can answer. The store keys a program by
what determines it instead: the package's source, the source files of the model's
classes, JAX's version and configuration, the devices, the XLA options, the parameters'
shapes and the call's static arguments and shapes; the executable comes back from
`jax.experimental.serialize_executable` with its donations and pytrees.

Not in the key: anything else a program reads while it is traced (a function of the
package replaced at run time, for example). Turn the store off
(``EngineConfig.compilation_cache=False``) in a process that patches the package.
"""
from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import pickle
import re
import sys
import tempfile
from typing import Any, Callable

import jax
import numpy as np

logger = logging.getLogger(__name__)

STORE_FORMAT = 2
"""Bumped when the files' layout changes; part of every key. 2: the executable's device
ids are stored with it."""

_UNKEYED_CONFIG_PREFIXES = (
    "jax_compilation_cache", "jax_enable_compilation_cache", "jax_persistent_cache", "jax_raise_persistent_cache",
    "jax_log", "jax_explain_cache_misses", "jax_debug_log_modules", "jax_logging_level",
)
"""JAX options that change where programs are cached or what is logged, not a program."""

_PACKAGE_ROOT = pathlib.Path(__file__).resolve().parent.parent

try:  # the JAX options in effect where a program is traced, contexts included (what jit keys on)
    from jax._src.config import trace_context as _trace_context
except ImportError:  # pragma: no cover - every JAX the package supports has it
    _trace_context = None


def _digest_files(paths: list[pathlib.Path]) -> str:
    h = hashlib.sha256()
    for path in sorted(set(paths)):
        h.update(str(path).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def package_source_digest() -> str:
    """SHA-256 of every source and table file of the package (its code decides every
    program it traces)."""
    files = [p for p in _PACKAGE_ROOT.rglob("*") if p.suffix in (".py", ".json") and p.is_file()]
    return _digest_files(files)


def model_source_files(model: Any) -> tuple[list[pathlib.Path], str | None]:
    """The source files of the classes that make up ``model`` (an nnx module tree) and
    None, or ``([], reason)`` when a class has no source file (defined in a notebook
    cell or an interactive session): a program of such a model cannot be keyed."""
    from flax import nnx

    files = []
    for _, node in nnx.graph.iter_graph(model):
        cls = type(node)
        if cls.__module__ in ("builtins", "numpy") or not isinstance(node, nnx.Module):
            continue
        path = getattr(sys.modules.get(cls.__module__), "__file__", None)
        if not path or not os.path.isfile(path):
            return [], f"{cls.__qualname__} has no source file (defined in {cls.__module__})"
        files.append(pathlib.Path(path).resolve())
    return files, None


def model_key(graphdef: Any, model: Any, params: tuple, compiler_options: Any) -> tuple[list[str], str | None]:
    """The key lines of ``model``'s programs (`environment_key`, the package's and the
    model's source, its structure and static attributes (``graphdef``, its nnx graph
    definition), its parameters' shapes, the XLA options) and None; or ``([], reason)``
    when the model cannot be keyed."""
    if _trace_context is None:
        return [], f"jax {jax.__version__} does not expose the options a trace depends on"
    files, reason = model_source_files(model)
    if reason:
        return [], reason
    # Function attributes print with their addresses, which differ between processes;
    # their code is in the source digests.
    structure = re.sub(r"0x[0-9a-f]+", "0x?", repr(graphdef))
    leaves = [(x.shape, str(x.dtype), str(x.sharding)) for x in params]
    return [*environment_key(), f"package {package_source_digest()}", f"model files {_digest_files(files)}",
            f"model {structure}", f"params {leaves!r}", f"compiler options {compiler_options!r}"], None


def environment_key() -> list[str]:
    """What outside the package and the model decides a compiled program: JAX and its
    configuration, XLA's flags and the devices."""
    import jaxlib

    devices = jax.devices()
    config = sorted((k, v) for k, v in jax.config.values.items() if not k.startswith(_UNKEYED_CONFIG_PREFIXES))
    return [f"format {STORE_FORMAT}", f"jax {jax.__version__}", f"jaxlib {jaxlib.__version__}",
            f"backend {jax.default_backend()} {getattr(devices[0].client, 'platform_version', '')}",
            f"devices {len(devices)} x {devices[0].device_kind}", f"XLA_FLAGS {os.environ.get('XLA_FLAGS', '')}",
            f"config {config!r}"]


def call_signature(args: tuple, static: dict[str, Any]) -> tuple:
    """Hashable key of a call, cheap enough for every call (tens of microseconds): its
    static keyword arguments, the JAX options in effect (``jax.default_matmul_precision``
    and other contexts included), the arguments' pytree structure, and each leaf's shape,
    dtype and weak type. Shardings are left out: an engine's runner places each argument
    the same way at every call, and a compiled program refuses an argument placed
    otherwise (it raises; it never runs on it)."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    return (tuple(sorted(static.items())), _trace_context(), treedef,
            tuple((x.shape, x.dtype, getattr(x, "weak_type", False)) if hasattr(x, "dtype")
                  else (np.shape(x), np.result_type(x), True) for x in leaves))


def signature_text(signature: tuple) -> str:
    """`call_signature` as text that is the same in every process (the store's file key)."""
    static, context, treedef, leaves = signature
    text = repr((static, context, str(treedef), [tuple(str(part) for part in leaf) for leaf in leaves]))
    return re.sub(r"0x[0-9a-f]+", "0x?", text)  # object addresses differ between processes


class ProgramStore:
    """A directory of serialized executables of one model's programs.

    Args:
      directory: where the files live (created if missing).
      program_key: what decides the programs besides each call (`environment_key`, the
        package and model source digests, the parameters' shapes, the XLA options).
    """

    def __init__(self, directory: str | os.PathLike, program_key: list[str]) -> None:
        self.directory = pathlib.Path(directory)
        self._base = hashlib.sha256("\n".join(program_key).encode()).hexdigest()
        self.num_loaded = 0  # programs read from the directory
        self.num_stored = 0  # programs compiled and written to it
        self.num_unserializable = 0  # programs compiled that the backend could not serialize

    def _path(self, name: str, signature: tuple) -> pathlib.Path:
        key = hashlib.sha256(f"{self._base}\n{name}\n{signature_text(signature)}".encode()).hexdigest()
        return self.directory / f"{name}-{key[:40]}.jaxexe"

    def load_or_compile(self, name: str, jitted: Any, args: tuple, static: dict[str, Any], signature: tuple) -> Any:
        """The `jax.stages.Compiled` of ``jitted(*args, **static)``: read from the store,
        or traced, compiled and written to it. A file that cannot be read (another JAX
        build, a torn write) is compiled anew and replaced, said in the log."""
        from jax.experimental import serialize_executable

        path = self._path(name, signature)
        if path.exists():
            try:
                payload, in_tree, out_tree, device_ids = pickle.loads(path.read_bytes())
                compiled = serialize_executable.deserialize_and_load(
                    payload, in_tree, out_tree, execution_devices=_devices_by_id(device_ids))
                self.num_loaded += 1
                return compiled
            except Exception as error:  # noqa: BLE001 - any unreadable file is recompiled
                logger.warning("program store: %s could not be loaded (%s: %s); compiling it again",
                               path.name, type(error).__name__, error)
        compiled = jitted.trace(*args, **static).lower().compile()
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        except Exception as error:  # noqa: BLE001 - the program runs; only the next start pays
            # XLA:CPU cannot serialize an executable with a sort once it has run, and
            # JAX hands back the executable its jit already compiled and ran in this
            # process (an engine without the store ran the same program): such a program
            # is compiled (or read from JAX's cache) at the next start.
            self.num_unserializable += 1
            logger.warning("program store: %s cannot be serialized on this backend (%s: %s); it is compiled again at "
                           "the next start", path.name, type(error).__name__, error)
            return compiled
        try:
            data = pickle.dumps((payload, in_tree, out_tree, _execution_device_ids(compiled)))
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, delete=False, suffix=".tmp") as f:
                f.write(data)
            os.replace(f.name, path)  # readers see the whole file or none
            self.num_stored += 1
        except OSError as error:  # the program runs; only the next start pays
            logger.warning("program store: %s not written (%s)", path.name, error)
        return compiled


def _execution_device_ids(compiled: Any) -> list[int] | None:
    """Ids of the devices ``compiled`` runs on, in its device assignment's order (None
    where the runtime does not say)."""
    executable = compiled.runtime_executable()
    devices = executable.local_devices() if hasattr(executable, "local_devices") else None
    return None if devices is None else [device.id for device in devices]


def _devices_by_id(device_ids: list[int] | None) -> list[Any] | None:
    """The devices of ``device_ids`` (a KeyError names a missing one: the program is
    compiled again). Without ids the loader takes every device of the backend, which
    fails a one-device program on a host of several at its first call."""
    if device_ids is None:
        return None
    devices = {device.id: device for device in jax.devices()}
    return [devices[i] for i in device_ids]


class StoredProgram:
    """Calls ``jitted`` through a `ProgramStore`: one executable per call signature,
    loaded or compiled on its first call (`call_signature`). With ``params_first`` the
    first argument is the runner's parameters, whose shapes are in the store's key, and
    is left out of the per-call signature (hundreds of leaves, the same at every call)."""

    def __init__(self, jitted: Any, name: str, store: ProgramStore, *, params_first: bool) -> None:
        self.jitted = jitted
        self.name = name
        self.store = store
        self._skip = 1 if params_first else 0
        self._compiled: dict[tuple, Callable[..., Any]] = {}

    def __call__(self, *args: Any, **static: Any) -> Any:
        signature = call_signature(args[self._skip:], static)
        compiled = self._compiled.get(signature)
        if compiled is None:
            compiled = self.store.load_or_compile(self.name, self.jitted, args, static, signature)
            self._compiled[signature] = compiled
        return compiled(*args)
