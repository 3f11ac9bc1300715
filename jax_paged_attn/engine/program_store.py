"""Compiled engine programs kept on disk, so that a second start loads them instead of
tracing the model again.

JAX's persistent compilation cache keys a program by its lowered module, so a warm
start with that cache alone still traces and lowers every program (about 1.5 s each for a
16-layer model's decode window on a 2-core CPU host) before the cache can answer. The
store keeps each program as a `jax.export` artifact (StableHLO in a flatbuffer: data,
never code or a pickle) and, at the next start, reads it back, wraps it in a ``jax.jit``
with the program's donations and compiles that wrapper, whose executable comes from
JAX's persistent cache: a start with both traces no model and compiles nothing. The cold
path compiles the same wrapper (export, read back, wrap, compile), so that the cache
holds exactly what the warm path asks for. Beside the programs it keeps figures measured
once per key (`read_figure` / `write_figure`: the KV-cache sizing's activation bytes, whose
measurement traces and compiles the model's largest step), so that the warm start's claim
holds on a GPU too. A single-device model's programs place every argument on its device,
so they can be compiled from their shapes alone: at the runner's start the store reads and
compiles, in a pool of threads (`prefetch`), the programs the last warm-up of the same
engine configuration used, in its order (`write_manifest`; every program it holds under
the model's key where none is recorded: a store shared by many configurations and models
costs a start only its own), and the warm-up's calls take them from there.

Where: a directory beside JAX's persistent cache (the engine's ``compilation_cache_dir``),
used only when it is trusted (`trusted_directory.untrusted_directory_reason`: owned by this user, not
writable by group or others, nor any ancestor unless sticky): whoever can write there
chooses the code this process runs, through JAX's cache if not through the store.

What is keyed, and stored inside each file (a JSON header before the payload, compared
line by line on load; the file name is only a hash of it): the package's source, the
source files of the model's classes, the model's structure, its parameters' shapes,
dtypes and shardings, the XLA options, JAX's and jaxlib's versions and configuration,
XLA_FLAGS, the backend and devices, the program's name, its call signature and static
arguments, and its donated arguments. The header also carries the payload's length and
SHA-256 (a torn or truncated file).

On a mismatch, a stale, torn or foreign file, or a program that fails to load or is
refused at its first call before it ran: the program is traced and compiled again and
the file replaced, said once in the log (a warning naming the file and why). Files are
written to a temporary file in the same directory and renamed over the old one, so
processes sharing the directory see a whole file or none.

Not in the key: anything else a program reads while it is traced (a function of the
package replaced at run time, for example). Turn the store off
(``EngineConfig.compilation_cache=False``) in a process that patches the package.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import logging
import os
import pathlib
import re
import sys
import tempfile
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from jax_paged_attn import dispatch

logger = logging.getLogger(__name__)

STORE_FORMAT = 3
"""Bumped when the files' layout changes; part of every key. 3: `jax.export` artifacts
behind a JSON header holding the whole key (2 and before: pickled executables)."""

FILE_MAGIC = b"jax_paged_attn program store\n"
"""First bytes of every file the store writes; anything else is not read further."""

FILE_SUFFIX = ".jaxprog"
FIGURE_SUFFIX = ".figure"
"""Files of figures measured once per key (`read_figure`) and of warm-up manifests (`write_manifest`)."""
_PROGRAM_FILE_NAME = re.compile(r"[A-Za-z0-9_]+-[0-9a-f]{40}" + re.escape(FILE_SUFFIX))  # `ProgramStore._path`'s names

# The engine's programs may hold Pallas Triton kernels: XLA does not promise to read a
# Triton custom call of another version, and the key pins JAX, jaxlib and the devices,
# so export's stability check has nothing to add for them. (Mosaic GPU's target,
# ``mosaic_gpu_v2``, is on export's stable list.)
_DISABLED_EXPORT_CHECKS = (jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton"),)

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
            f"plugins {_plugin_versions()}",
            f"backend {jax.default_backend()} {getattr(devices[0].client, 'platform_version', '')}",
            f"devices {len(devices)} x {devices[0].device_kind}", f"XLA_FLAGS {os.environ.get('XLA_FLAGS', '')}",
            f"config {config!r}"]


@functools.lru_cache(maxsize=1)
def _plugin_versions() -> str:
    """The installed JAX PJRT plugins and their versions (``jax-cuda13-plugin`` and the
    like): a plugin upgrade changes the compiler without changing jax or jaxlib."""
    from importlib import metadata

    plugins = sorted((dist.metadata["Name"] or "", dist.version) for dist in metadata.distributions()
                     if (dist.metadata["Name"] or "").lower().startswith(("jax-cuda", "jax_cuda", "jax-rocm", "jax-tpu")))
    return ", ".join(f"{name} {version}" for name, version in plugins) or "none"


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


def _encode_aux(value: Any) -> Any:
    """JSON of a pytree node's static data, tuples tagged (JSON has only lists, and a
    tree with a list where the program had a tuple is another tree)."""
    if isinstance(value, tuple):
        return {"tuple": [_encode_aux(v) for v in value]}
    if isinstance(value, list):
        return [_encode_aux(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"pytree static data {value!r} ({type(value).__name__}) has no JSON form")


def _decode_aux(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(_decode_aux(v) for v in value["tuple"])
    if isinstance(value, list):
        return [_decode_aux(v) for v in value]
    return value


def register_pytree_serialization(*node_types: type) -> None:
    """Lets `jax.export` write and read pytree nodes of ``node_types`` (registered with
    ``jax.tree_util``; static data of JSON types: ints, floats, strings, None, tuples and
    lists of them), so that a stored program's argument and result trees come back as
    the engine's own types. Registering a type twice is a no-op."""
    from jax._src.export import _export as export_internals  # the registry export consults

    for node_type in node_types:
        if node_type in export_internals.serialization_registry:
            continue
        jax.export.register_pytree_node_serialization(
            node_type, serialized_name=f"{node_type.__module__}.{node_type.__qualname__}",
            serialize_auxdata=lambda aux: json.dumps(_encode_aux(aux)).encode(),
            deserialize_auxdata=lambda data: _decode_aux(json.loads(data)))


def _compile_exported(exported: jax.export.Exported, donated: Sequence[int], leaves: Sequence[Any],
                      compiler_options: Mapping[str, Any] | None, device: Any = None) -> Any:
    """The `jax.stages.Compiled` of ``exported`` called on the flat argument ``leaves``,
    donating the leaves at ``donated``, compiled with ``compiler_options`` (export keeps
    the program, not its jit's XLA options). The wrapper is the same function in every process
    and on both paths, so its lowered module (and JAX's persistent cache key) is too. With
    ``device`` every argument is placed on it (``in_shardings``), so the module does not
    depend on which arguments came committed to a device: arguments given as shapes
    (`ProgramStore.prefetch`) lower to the module a call's arrays do."""
    in_tree = exported.in_tree

    def stored_program(*flat: Any) -> Any:
        args, kwargs = jax.tree_util.tree_unflatten(in_tree, flat)
        return exported.call(*args, **kwargs)

    placed = {} if device is None else dict(
        in_shardings=tuple(jax.sharding.SingleDeviceSharding(device) for _ in exported.in_avals))
    wrapper = jax.jit(stored_program, donate_argnums=tuple(donated), **placed)
    dispatch.prepare_lowering_runtimes(exported.mlir_module_serialized)
    return wrapper.trace(*leaves).lower().compile(compiler_options=dict(compiler_options or {}) or None)


def _donated_leaves(args: tuple, donate_argnums: Sequence[int]) -> list[int]:
    """Indices, among the leaves of ``(args, {})``, of the leaves of the donated arguments."""
    donated, start = [], 0
    for i, arg in enumerate(args):
        count = len(jax.tree_util.tree_leaves(arg))
        if i in donate_argnums:
            donated.extend(range(start, start + count))
        start += count
    return donated


def _mismatch(exported: jax.export.Exported, in_tree: Any, leaves: Sequence[Any]) -> str | None:
    """How the call (``in_tree``, ``leaves``) differs from what ``exported`` takes, or
    None: checked before a loaded program first runs, so that a program of another
    signature is refused while its donated arguments are still alive."""
    if exported.in_tree != in_tree:
        return f"its arguments' tree {exported.in_tree} is not the call's {in_tree}"
    for i, (aval, leaf) in enumerate(zip(exported.in_avals, leaves)):
        dtype = getattr(leaf, "dtype", None)  # a Python scalar takes the program's type
        if tuple(aval.shape) != tuple(np.shape(leaf)) or (
                dtype is not None and aval.dtype != _canonical_dtype(dtype)):
            return f"argument leaf {i} is {aval.str_short()} in the file, {dtype}{list(np.shape(leaf))} here"
    return None


def _canonical_dtype(dtype: Any) -> np.dtype:
    """The dtype jit gives an argument of ``dtype`` (64-bit types narrowed without x64)."""
    canonicalize = getattr(jax.dtypes, "canonicalize_dtype", None)
    return np.dtype(dtype) if canonicalize is None else canonicalize(dtype)


class StoredFileError(Exception):
    """A store file that is not the program asked for (the message says why)."""


class ProgramStore:
    """A directory of `jax.export` artifacts of one model's programs (see the module
    docstring for what it trusts and keys).

    Args:
      directory: where the files live (created with mode 0o700 if missing; the caller
        checks it is trusted: `trusted_directory.make_private_directory`).
      program_key: what decides the programs besides each call (`model_key`: the
        environment, the package and model source digests, the parameters' shapes, the
        XLA options).
      device: where every argument of a single-device model's programs is placed (its
        programs can then be compiled ahead from shapes alone: `prefetch`); None for a
        model over several devices.
    """

    def __init__(self, directory: str | os.PathLike, program_key: list[str], device: Any = None) -> None:
        self.directory = pathlib.Path(directory)
        self.program_key = list(program_key)
        self.device = device  # the one device of a single-device model (`_compile_exported`), else None
        self._base = hashlib.sha256("\n".join(self.program_key).encode()).hexdigest()
        self.num_loaded = 0  # programs read from the directory
        self.num_prefetched = 0  # of those, compiled ahead by `prefetch`
        self._prefetched: dict[pathlib.Path, concurrent.futures.Future[_Prefetched | None]] = {}
        self.num_stored = 0  # programs compiled and written to it
        self.num_unserializable = 0  # programs export refused: compiled by their plain jit, not stored
        self.used: list[str] = []  # file names of the programs this process took from the store or wrote, in order
        self.prefetched_from_manifest = False  # `prefetch` took its files from a `write_manifest` list

    def prefetch(self, compiler_options: Mapping[str, Mapping[str, Any] | None], manifest_lines: Sequence[str] = (),
                 max_workers: int = 8) -> int:
        """Starts reading and compiling, in a pool of threads, the programs a warm-up under
        ``manifest_lines`` (the engine's configuration) used last time, in its order
        (`write_manifest`), or with no such list every program stored under this store's
        key (``compiler_options``: each program name's XLA options), so a warm start loads
        them side by side (each compilation, mostly a cache read and a load, releases the
        GIL); returns how many files it started on (0 without a ``device``).
        `load_or_compile` takes a program from there once its file's key and the call's
        arguments match; any other is loaded or compiled as without this."""
        if self.device is None:
            return 0
        names = self._read_value("manifest", manifest_lines)
        self.prefetched_from_manifest = isinstance(names, list) and all(
            isinstance(n, str) and _PROGRAM_FILE_NAME.fullmatch(n) for n in names)
        paths = ([self.directory / n for n in names] if self.prefetched_from_manifest
                 else sorted(self.directory.glob(f"*{FILE_SUFFIX}")))
        if not paths:
            return 0
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="program-prefetch")
        for path in paths:
            self._prefetched[path] = pool.submit(self._prefetch_one, path, compiler_options)
        pool.shutdown(wait=False)
        return len(paths)

    def _prefetch_one(self, path: pathlib.Path, compiler_options: Mapping[str, Mapping[str, Any] | None]
                      ) -> "_Prefetched | None":
        try:
            header, payload = self._split(path.read_bytes())
            key = header.get("key")
            if not isinstance(key, list) or key[:len(self.program_key)] != self.program_key:
                return None  # another model's or another environment's
            lines = dict(line.split(" ", 1) for line in key[len(self.program_key):])
            name, donated = lines["program"], json.loads(lines["donated"])
            if len(payload) != header["payload_bytes"] or hashlib.sha256(payload).hexdigest() != header[
                    "payload_sha256"]:
                return None  # torn: compiled anew when called
            exported = jax.export.deserialize(bytearray(payload))
            shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in exported.in_avals]
            compiled = _compile_exported(exported, donated, shapes, compiler_options.get(name), self.device)
            return _Prefetched(key, exported, compiled)
        except Exception as error:  # noqa: BLE001 - the program is loaded, or compiled, when first called
            logger.info("program store: %s not prefetched (%s: %s)", path.name, type(error).__name__, error)
            return None

    def read_figure(self, name: str, key_lines: Sequence[str]) -> int | None:
        """A figure measured at an earlier start under the same key (the store's key and
        ``key_lines``), or None when none is stored; a file that is not this figure is
        said once in the log and left for `write_figure` to replace."""
        value = self._read_value(name, key_lines)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            logger.warning("program store: figure %s is %r, not an integer; measuring again", name, value)
            return None
        return value

    def write_figure(self, name: str, key_lines: Sequence[str], value: int) -> None:  # for `read_figure`
        self._write_value(name, key_lines, int(value))

    def write_manifest(self, manifest_lines: Sequence[str]) -> None:
        """Records the programs this process used so far (`used`), in order, as the list
        the next `prefetch` under ``manifest_lines`` reads, so that a warm start reads
        and compiles its own programs first and no other configuration's or model's."""
        if self.used:
            self._write_value("manifest", manifest_lines, list(dict.fromkeys(self.used)))

    def _read_value(self, name: str, key_lines: Sequence[str]) -> Any:
        path, key = self._figure_path(name, key_lines)
        if not path.exists():
            return None
        try:
            return json.loads(self._read(path, key))["value"]
        except (StoredFileError, ValueError, TypeError, KeyError) as error:
            logger.warning("program store: %s not used (%s)", path, error)
            return None

    def _write_value(self, name: str, key_lines: Sequence[str], value: Any) -> None:
        path, key = self._figure_path(name, key_lines)
        self._write(path, key, json.dumps({"value": value}).encode())

    def _figure_path(self, name: str, key_lines: Sequence[str]) -> tuple[pathlib.Path, list[str]]:
        key = [*self.program_key, f"figure {name}", *key_lines]
        digest = hashlib.sha256("\n".join(key).encode()).hexdigest()
        return self.directory / f"{name}-{digest[:40]}{FIGURE_SUFFIX}", key

    def _path(self, name: str, signature: tuple) -> pathlib.Path:
        key = hashlib.sha256(f"{self._base}\n{name}\n{signature_text(signature)}".encode()).hexdigest()
        return self.directory / f"{name}-{key[:40]}{FILE_SUFFIX}"

    def file_key(self, name: str, signature: tuple, donated: Sequence[int]) -> list[str]:
        """The key lines a file of program ``name`` at ``signature`` must hold."""
        return [*self.program_key, f"program {name}", f"call {signature_text(signature)}", f"donated {list(donated)}"]

    def load_or_compile(self, name: str, jitted: Any, args: tuple, static: dict[str, Any], signature: tuple, *,
                        donate_argnums: Sequence[int] = (), compiler_options: Mapping[str, Any] | None = None
                        ) -> Callable[..., Any]:
        """A function of ``args`` that runs ``jitted(*args, **static)``'s program, read
        from the store, or traced, exported, compiled and written to it.
        ``donate_argnums`` and ``compiler_options`` are ``jitted``'s (export keeps
        neither; a loaded program gets them back from here, untraced). A file that is not
        this program (another key, a torn write, a foreign file) or that fails to load is
        compiled anew and replaced, said once in the log."""
        leaves, in_tree = jax.tree_util.tree_flatten((args, {}))
        donated = _donated_leaves(args, donate_argnums)
        path = self._path(name, signature)
        key = self.file_key(name, signature, donated)
        future = self._prefetched.pop(path, None)
        ahead = None if future is None else future.result()
        if ahead is not None and ahead.key == key and _mismatch(ahead.exported, in_tree, leaves) is None:
            self.num_loaded += 1
            self.num_prefetched += 1
            self.used.append(path.name)
            return _FlatCall(ahead.compiled)
        if path.exists():
            try:
                exported = jax.export.deserialize(bytearray(self._read(path, key)))
                reason = _mismatch(exported, in_tree, leaves)
                if reason:
                    raise StoredFileError(f"it does not fit the call: {reason}")
                compiled = _compile_exported(exported, donated, leaves, compiler_options, self.device)
                self.num_loaded += 1
                self.used.append(path.name)
                return _FlatCall(compiled)
            except Exception as error:  # noqa: BLE001 - any file that is not this program is recompiled
                logger.warning("program store: %s not used (%s: %s); compiling the program again",
                               path, type(error).__name__, error)
        traced = jitted.trace(*args, **static)  # jit keeps it: export below does not trace again
        traced_donated = [i for i, info in enumerate(jax.tree_util.tree_leaves(traced.args_info)) if info.donated]
        if traced_donated != donated:
            raise ValueError(f"donate_argnums={tuple(donate_argnums)} of the stored program {name!r} are not its jit's "
                             f"(donated leaves {traced_donated}, not {donated})")
        try:
            data = jax.export.export(jitted, disabled_checks=_DISABLED_EXPORT_CHECKS)(*args, **static).serialize()
            # What the warm path compiles, so that JAX's persistent cache holds it.
            compiled = _compile_exported(jax.export.deserialize(data), donated, leaves, compiler_options, self.device)
        except Exception as error:  # noqa: BLE001 - the program still runs; only the next start pays
            self.num_unserializable += 1
            logger.warning("program store: %s cannot be exported (%s: %s); it is compiled without the store, "
                           "and again at the next start", path.name, type(error).__name__, error)
            return traced.lower().compile()
        self.num_stored += self._write(path, key, bytes(data))
        self.used.append(path.name)
        return _FlatCall(compiled)

    @staticmethod
    def _split(data: bytes) -> tuple[dict[str, Any], bytes]:
        """A file's JSON header and payload; raises `StoredFileError` saying why not.
        Nothing of the file is interpreted before the magic bytes and the JSON header
        check out."""
        if not data.startswith(FILE_MAGIC):
            raise StoredFileError("not a program store file (no magic bytes)")
        end = data.find(b"\n", len(FILE_MAGIC))
        if end < 0:
            raise StoredFileError("torn file: the header is incomplete")
        try:
            header = json.loads(data[len(FILE_MAGIC):end])
            if not isinstance(header, dict):
                raise TypeError("not an object")
        except (ValueError, TypeError) as error:
            raise StoredFileError(f"unreadable header ({error})") from None
        return header, data[end + 1:]

    @classmethod
    def _read(cls, path: pathlib.Path, key: list[str]) -> bytes:
        """The payload of ``path`` once its header matches ``key`` and its length and
        SHA-256 match the header; raises `StoredFileError` saying why not."""
        header, payload = cls._split(path.read_bytes())
        try:
            file_format, file_key = header["format"], header["key"]
            length, digest = header["payload_bytes"], header["payload_sha256"]
        except KeyError as error:
            raise StoredFileError(f"unreadable header ({error})") from None
        if file_format != STORE_FORMAT:
            raise StoredFileError(f"store format {file_format!r}, this package reads {STORE_FORMAT}")
        if file_key != key:
            differing = next((theirs, ours) for theirs, ours in zip([*file_key, ""], [*key, ""]) if theirs != ours)
            label = (differing[1] or differing[0]).split(" ", 1)[0]
            raise StoredFileError(f"it holds another program: its key differs at {label!r}")
        if len(payload) != length or hashlib.sha256(payload).hexdigest() != digest:
            raise StoredFileError(f"torn file: {len(payload)} payload bytes of {length}, or their SHA-256 differs")
        return payload

    def _write(self, path: pathlib.Path, key: list[str], payload: bytes) -> bool:
        header = dict(format=STORE_FORMAT, key=key, payload_bytes=len(payload),
                      payload_sha256=hashlib.sha256(payload).hexdigest())
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, delete=False, prefix=".", suffix=".tmp") as f:
                f.write(FILE_MAGIC + json.dumps(header).encode() + b"\n" + payload)
            os.replace(f.name, path)  # readers see the whole file or none
            return True
        except OSError as error:  # the program runs; only the next start pays
            logger.warning("program store: %s not written (%s)", path, error)
            return False


@dataclasses.dataclass(frozen=True)
class _Prefetched:
    """A program `ProgramStore.prefetch` read and compiled: its file's key, export, wrapper."""

    key: list[str]
    exported: jax.export.Exported
    compiled: Any


class _FlatCall:
    """Calls a compiled flat-leaf wrapper (`_compile_exported`) with the program's
    argument tree."""

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled

    def __call__(self, *args: Any) -> Any:
        return self.compiled(*jax.tree_util.tree_leaves((args, {})))


class StoredProgram:
    """Calls ``jitted`` through a `ProgramStore`: one program per call signature,
    loaded or compiled on its first call (`call_signature`). With ``params_first`` the
    first argument is the runner's parameters, whose shapes are in the store's key, and
    is left out of the per-call signature (hundreds of leaves, the same at every call).
    ``donate_argnums`` and ``compiler_options``: ``jitted``'s (checked against its trace
    when a program is compiled), given to the loaded programs, which are not traced.

    A stored program refused at a call before it ran (its donated arguments still alive)
    is replaced by ``jitted`` for that signature, said once; one that failed after
    consuming its donations raises."""

    def __init__(self, jitted: Any, name: str, store: ProgramStore, *, params_first: bool,
                 donate_argnums: Sequence[int] = (), compiler_options: Mapping[str, Any] | None = None) -> None:
        self.jitted = jitted
        self.donate_argnums = tuple(donate_argnums)
        self.compiler_options = compiler_options
        self.name = name
        self.store = store
        self._skip = 1 if params_first else 0
        self._compiled: dict[tuple, Callable[..., Any]] = {}

    def __call__(self, *args: Any, **static: Any) -> Any:
        signature = call_signature(args[self._skip:], static)
        compiled = self._compiled.get(signature)
        if compiled is None:
            compiled = self.store.load_or_compile(self.name, self.jitted, args, static, signature,
                                                  donate_argnums=self.donate_argnums,
                                                  compiler_options=self.compiler_options)
            self._compiled[signature] = compiled
        if not isinstance(compiled, _FlatCall):
            return compiled(*args)
        try:
            return compiled(*args)
        except Exception as error:
            if any(getattr(leaf, "is_deleted", lambda: False)() for leaf in jax.tree_util.tree_leaves(args)):
                raise  # it ran (and took its donations): nothing to retry with
            logger.warning("program store: the stored %s program refused its call (%s: %s); using the traced "
                           "program instead", self.name, type(error).__name__, error)
            compiled = self._compiled[signature] = self.jitted.trace(*args, **static).lower().compile()
            return compiled(*args)
