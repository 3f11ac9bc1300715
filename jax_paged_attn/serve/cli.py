"""``jax-paged-attn serve MODEL_DIR`` (also ``python -m jax_paged_attn.serve``): owns the
command line, loading the checkpoint, warming up and running uvicorn with a graceful
SIGTERM.

Order at start: the flags are checked (an `EngineConfig` is built from them, so a bad
value is an argparse error naming its flag before anything loads), the checkpoint and
tokenizer load through `LLM`, every program is compiled or loaded from the program
store (`LLMEngine.warmup`; ``--no-warmup`` skips it, for CPU tests), and only then does
the port open. With the engine process, it is spawned first, before this process imports
JAX (`jax_paged_attn.serve.engine_process`; ``import jax_paged_attn`` loads nothing
until used): it imports the engine while this process checks the flags, then loads and
warms up while this process imports the HTTP stack and reads the tokenizer and the chat
template; refused flags end it. One log line says what the server chose where the user
did not.

``--engine-core``: ``process`` (the default) runs the engine loop in an engine process of
its own, which loads the model and warms up while the server's process holds only the
tokenizer, so the engine's host work and the HTTP server's do not share one GIL
(`jax_paged_attn.serve.engine_core`); ``thread`` runs it in a thread of the server's
process (one process; measured on an H200 at 0.79x the process core's total tok/s on the
serving benchmark, 2026-12-06).

SIGTERM / Ctrl-C: new requests get 503 (``/health`` too), the running ones finish for
up to ``--shutdown-timeout`` seconds, then the rest are aborted and the process exits.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from jax_paged_attn.serve.engine_process import EngineProcess

logger = logging.getLogger("jax_paged_attn.serve")

DEFAULT_WAITING_PER_SEQ = 16
"""``--max-waiting-requests`` default: this many waiting sequences per ``max_num_seqs``
slot, enough for a benchmark's burst, small enough to bound the server's memory."""

ENGINE_FLAGS = {  # EngineConfig field -> its flag
    "max_model_len": "--max-model-len",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "num_blocks": "--num-blocks",
    "block_size": "--block-size",
    "swap_space_gib": "--swap-space",
    "num_scheduler_steps": "--num-scheduler-steps",
    "latency_scheduler_steps": "--latency-scheduler-steps",
    "latency_max_rows": "--latency-max-rows",
    "seed": "--seed",
    "enable_prefix_caching": "--no-enable-prefix-caching",
    "compilation_cache": "--no-compilation-cache",
    "compilation_cache_dir": "--compilation-cache-dir",
}


def build_parser() -> argparse.ArgumentParser:
    from jax_paged_attn.cache import KV_CACHE_DTYPES
    from jax_paged_attn.engine import EngineConfig

    parser = argparse.ArgumentParser(
        prog="jax-paged-attn serve",
        description="Serve a Hugging Face Llama checkpoint with an OpenAI-compatible HTTP API.")
    parser.add_argument("model", metavar="MODEL_DIR", help="checkpoint directory (config.json, *.safetensors, "
                        "tokenizer.json; tokenizer_config.json's chat_template for /v1/chat/completions)")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000, help="0 picks a free port (logged)")
    server.add_argument("--served-model-name", help="the model name clients send (default: MODEL_DIR as given)")
    server.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 and the tokenizer routes")
    server.add_argument("--max-waiting-requests", type=int,
                        help=f"sequences that may wait beyond --max-num-seqs before new requests get 503 "
                             f"(default {DEFAULT_WAITING_PER_SEQ} x --max-num-seqs)")
    server.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds running requests may take to finish after SIGTERM before they are aborted")
    server.add_argument("--no-warmup", action="store_true",
                        help="skip compiling every program before the port opens (tests on a CPU)")
    server.add_argument("--engine-core", default=None, choices=["thread", "process"],
                        help="where the engine loop runs: an engine process of its own (default), or a thread "
                             "of this process")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    model = parser.add_argument_group("model")
    model.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    model.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))
    model.add_argument("--tensor-parallel-size", type=int, default=1)
    model.add_argument("--implementation", default="auto", choices=["auto", "xla", "triton"],
                       help="attention implementation")
    engine = parser.add_argument_group("engine (EngineConfig)")
    engine.add_argument("--max-model-len", type=int, help="longest context (default: the model's)")
    engine.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    engine.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens)
    engine.add_argument("--gpu-memory-utilization", type=float, default=EngineConfig.gpu_memory_utilization)
    engine.add_argument("--num-blocks", type=int, help="KV-cache blocks (default: what fits in memory)")
    engine.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    engine.add_argument("--swap-space", type=float, default=EngineConfig.swap_space_gib, help="host swap GiB")
    engine.add_argument("--num-scheduler-steps", type=int, default=EngineConfig.num_scheduler_steps,
                        help="decode steps per window while requests queue")
    engine.add_argument("--latency-scheduler-steps", type=int, default=EngineConfig.latency_scheduler_steps,
                        help="decode steps per window while no request waits (default: --num-scheduler-steps)")
    engine.add_argument("--latency-max-rows", type=int, default=EngineConfig.latency_max_rows,
                        help="--latency-scheduler-steps windows only while at most this many requests run")
    engine.add_argument("--seed", type=int, default=EngineConfig.seed)
    engine.add_argument("--no-enable-prefix-caching", action="store_true")
    engine.add_argument("--no-compilation-cache", action="store_true")
    engine.add_argument("--compilation-cache-dir")
    engine.add_argument("--engine-options", type=json.loads, default={}, metavar="JSON",
                        help='more EngineConfig fields as a JSON object, e.g. \'{"batch_buckets": [4]}\'')
    return parser


def engine_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The `EngineConfig` fields the flags set, checked by building one (argparse errors
    naming the flag)."""
    from jax_paged_attn.engine import EngineConfig

    options = dict(
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
        num_blocks=args.num_blocks, block_size=args.block_size, swap_space_gib=args.swap_space,
        num_scheduler_steps=args.num_scheduler_steps, latency_scheduler_steps=args.latency_scheduler_steps,
        latency_max_rows=args.latency_max_rows,
        seed=args.seed,
        enable_prefix_caching=not args.no_enable_prefix_caching, compilation_cache=not args.no_compilation_cache,
        compilation_cache_dir=args.compilation_cache_dir)
    extra = args.engine_options
    if not isinstance(extra, dict):
        parser.error(f"argument --engine-options: must be a JSON object, got {extra!r}")
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    for name, value in extra.items():
        if name not in fields:
            parser.error(f"argument --engine-options: unknown EngineConfig field {name!r}; the fields are "
                         f"{sorted(fields)}")
        if name in ENGINE_FLAGS:
            parser.error(f"argument --engine-options: set {name} with {ENGINE_FLAGS[name]}")
        options[name] = tuple(value) if isinstance(value, list) else value
    try:
        EngineConfig(**options)
    except (TypeError, ValueError) as e:
        name = str(e).split(" ", 1)[0]
        parser.error(f"argument {ENGINE_FLAGS.get(name, '--engine-options')}: {e}")
    return options


def check_server_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if not 0 <= args.port < 65536:
        parser.error(f"argument --port: must be in [0, 65535], got {args.port}")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        parser.error(f"argument --max-waiting-requests: must be >= 0, got {args.max_waiting_requests}")
    if not args.shutdown_timeout >= 0:
        parser.error(f"argument --shutdown-timeout: must be >= 0, got {args.shutdown_timeout}")
    if args.tensor_parallel_size < 1:
        parser.error(f"argument --tensor-parallel-size: must be >= 1, got {args.tensor_parallel_size}")
    if not os.path.isdir(args.model):
        parser.error(f"argument MODEL_DIR: {args.model!r} is not a directory")
    if not os.path.isfile(os.path.join(args.model, "tokenizer.json")):
        parser.error(f"argument MODEL_DIR: {args.model!r} has no tokenizer.json; the server needs the tokenizer")


def spawn_engine_process_early(argv: Sequence[str]) -> "EngineProcess | None":
    """The engine process, spawned before this process imports JAX (it imports the
    engine meanwhile; `jax_paged_attn.serve.engine_process`), unless the command line
    asks for help or for the thread core."""
    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    early.add_argument("-h", "--help", action="store_true")
    early.add_argument("--engine-core", default="process")
    known, _ = early.parse_known_args(argv)
    if known.help or known.engine_core != "process":
        return None
    from jax_paged_attn.serve.engine_process import EngineProcess

    return EngineProcess()


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    spawned = spawn_engine_process_early(argv)
    try:
        _serve(argv, spawned)
    except BaseException:
        if spawned is not None and not spawned.started:
            spawned.cancel()  # refused flags (argparse's SystemExit), or a failure before the engine started
        raise


def _serve(argv: list[str], spawned: "EngineProcess | None") -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_server_args(args, parser)
    options = engine_options(args, parser)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    llm_options = dict(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                       implementation=None if args.implementation == "auto" else args.implementation,
                       tensor_parallel_size=args.tensor_parallel_size, **options)
    chose = []
    if args.engine_core is None:
        args.engine_core = "process"
        chose.append("--engine-core process (the engine loop in a process of its own, so its host work and the "
                     "HTTP server's do not share a GIL; --engine-core thread keeps one process)")
    core = None
    if spawned is not None and args.engine_core != "process":  # (an abbreviated --engine-core the early parse missed)
        spawned.cancel()
        spawned = None
    if args.engine_core == "process":  # first: the engine loads and warms up while this process starts the server
        from jax_paged_attn.serve.engine_core import ProcessCore

        core = ProcessCore(args.model, llm_options, warmup=not args.no_warmup, log_level=args.log_level.upper(),
                           process=spawned)
    try:
        import uvicorn

        from jax_paged_attn.serve.app import build_app
    except ImportError as e:
        sys.exit(f"jax-paged-attn serve needs FastAPI and uvicorn ({e}): pip install 'jax-paged-attn[serve]'")
    from jax_paged_attn.engine import LLM
    from jax_paged_attn.serve.async_engine import AsyncEngine
    from jax_paged_attn.serve.chat_template import load_chat_template

    model_name = args.served_model_name or args.model
    max_waiting = args.max_waiting_requests
    if max_waiting is None:
        max_waiting = DEFAULT_WAITING_PER_SEQ * options["max_num_seqs"]
    chose.insert(0, f"served model name {model_name!r}" + ("" if args.served_model_name else " (MODEL_DIR as given)"))
    if args.max_waiting_requests is None:
        chose.append(f"--max-waiting-requests {max_waiting} ({DEFAULT_WAITING_PER_SEQ} x --max-num-seqs)")
    if not args.api_key:
        chose.append("no API key (anyone who reaches the port may generate)")
    chat_template = load_chat_template(args.model)
    if chat_template is None:
        chose.append("no chat template in the checkpoint: /v1/chat/completions answers 400")
    logger.info("serve: chose %s.", "; ".join(chose))

    if args.no_warmup:
        logger.info("serve: --no-warmup: programs compile on first use (the first requests wait for them).")
    if core is not None:
        try:
            core.wait_ready()
        except RuntimeError as e:
            sys.exit(f"jax-paged-attn serve: {e}")
        if core.warmup_report is not None:
            logger.info("serve: warmup (engine process): %s", core.warmup_report)
        front = AsyncEngine(core=core, model_name=model_name, max_waiting_requests=max_waiting)
    else:
        llm = LLM(model=args.model, warmup=False, **llm_options)
        if not args.no_warmup:
            logger.info("serve: warmup: %s", llm.engine.warmup(use_tqdm=False))
        front = AsyncEngine(llm, model_name=model_name, max_waiting_requests=max_waiting)
    app = build_app(front, model_name=model_name, model_root=os.path.abspath(args.model),
                    chat_template=chat_template, api_key=args.api_key)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            front.accepting = False  # 503 for new requests on connections still open while running ones finish
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout)
    Server(config).run()


def command(argv: Sequence[str] | None = None) -> None:
    """The ``jax-paged-attn`` console script: ``jax-paged-attn serve MODEL_DIR [flags]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "serve":
        sys.exit("usage: jax-paged-attn serve MODEL_DIR [flags]  (jax-paged-attn serve --help lists them)")
    main(argv[1:])
