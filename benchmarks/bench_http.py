#!/usr/bin/env python3
"""Serving benchmark over HTTP, after vLLM's ``vllm bench serve``: `bench_serving.py`'s
workload and arrivals sent to a running OpenAI-compatible server (``jax-paged-attn
serve``, or any other) as streamed ``/v1/completions`` requests.

    python benchmarks/bench_http.py --write-checkpoint DIR [--quick]
    jax-paged-attn serve DIR --max-num-seqs 256 --max-num-batched-tokens 8192 ... &
    python benchmarks/bench_http.py --url URL --wait-ready 400 [--started-at EPOCH_S]
    python benchmarks/bench_http.py --url http://127.0.0.1:8000 [--model NAME] [--api-key KEY]
                                    [--num-requests 1000] [--rates inf,0.5x] [--prompt-lens 32,2048]
                                    [--output-lens 16,512] [--seed 0] [--json OUT.json]

``--write-checkpoint DIR`` saves the offline benchmark's model (`bench_engine.build_model`:
the random-weight 1.1B Llama in bfloat16; ``--quick`` the tiny one) as a Hugging Face
directory with a word-level tokenizer.json whose token ``w{i}`` is id ``i`` (the workload
sends ids, so any tokenizer covering the vocabulary serves), for the server to load.

**Workload and arrivals**: `bench_serving.make_workload` and `bench_serving.poisson_arrivals`
with the same seed, so the requests (token-id prompts, greedy, EOS ignored, ``max_tokens``
each) and the arrival pattern are the offline run's; ``--rates`` as there (``inf``: all at
once; a number: Poisson requests/s; ``Fx``: F times the ``inf`` run's request throughput).
The server must hold prompts of the workload's longest length plus its output.

**Client**: one asyncio task per request in flight (as ``vllm bench serve``; the standard
library's streams, HTTP/1.1 with the chunked body read as it arrives), each sending its
request when its arrival time comes and reading the Server-Sent Events as they arrive, so
no thread waits for a GIL between a chunk's arrival and its time stamp; the server's
vocabulary must hold the workload's ids (``--vocab-size``, default
the benchmark model's 32,000).

**Per rate**, vLLM's metrics: duration (first request sent to last response read), request
throughput, output and total (prompt + output) tok/s, failed requests (any status but 200,
an error event, a broken stream, or fewer tokens than asked), and at p50 / p90 / p99:
TTFT (sent to the first chunk with text), TPOT ((latency - TTFT) / (output tokens - 1) per
request), ITL (the gap between consecutive chunks with text, each chunk counting once
however many tokens it carries) and end-to-end latency. Output tokens are the usage
chunk's ``completion_tokens`` (``stream_options.include_usage``). Where the server reports
``jax_paged_attn:xla_compilations_total`` on ``/metrics`` (``jax-paged-attn serve`` does),
the compilations during each rate's run, which should be 0.

**Start-up** (``--wait-ready S``): polls ``/health`` until it answers 200 (at most S
seconds), then sends one completion of one token, and prints the seconds from
``--started-at`` (the server process's start, seconds since the epoch: ``date
+%s.%N`` before launching it; default this script's start) to the port's first 200 and
to that first served request.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import http.client
import json
import pathlib
import sys
import time
import urllib.parse
from typing import Any

_REPO = pathlib.Path(__file__).resolve().parents[1]
for _path in (_REPO, _REPO / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import numpy as np  # noqa: E402

from bench_engine import LLAMA_1B, build_model  # noqa: E402
from bench_serving import (Workload, length_range, make_workload, parse_rates, percentiles,  # noqa: E402
                           poisson_arrivals, rate_value)

DEFAULT_VOCAB_SIZE = LLAMA_1B.vocab_size  # the benchmark model's (bench_engine.py)
"""The vocabulary of `bench_engine.py`'s 1.1B Llama, whose ids the workload draws."""


@dataclasses.dataclass
class RequestResult:
    """One streamed request as the client saw it (times in s from the run's start)."""

    sent_s: float = 0.0
    first_text_s: float | None = None
    done_s: float | None = None
    chunk_times_s: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


async def stream_completion(url: str, body: dict[str, Any], headers: dict[str, str], start: float,
                            result: RequestResult) -> None:
    """Sends one streamed completion and records its chunks' arrival (``result``):
    HTTP/1.1 over an asyncio connection, the chunked body read as it arrives."""
    parts = urllib.parse.urlsplit(url)
    writer = None
    try:
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80, limit=1 << 22)
        payload = json.dumps(body).encode()
        head = "".join(f"{k}: {v}\r\n" for k, v in {**headers, "Host": parts.netloc,
                                                   "Content-Length": str(len(payload)),
                                                   "Connection": "close"}.items())
        result.sent_s = time.perf_counter() - start
        writer.write(f"POST /v1/completions HTTP/1.1\r\n{head}\r\n".encode() + payload)
        await writer.drain()
        status_line = await reader.readline()
        status = int(status_line.split()[1])
        response_headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            response_headers[name.strip().lower()] = value.strip()
        if status != 200:
            result.error = f"HTTP {status}: {(await reader.read(300))!r}"
            return
        chunked = response_headers.get("transfer-encoding", "").lower() == "chunked"
        finished, pending = False, b""
        while not finished:
            if chunked:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    break
                data = await reader.readexactly(size + 2)
                data = data[:-2]
            else:
                data = await reader.read(1 << 16)
                if not data:
                    break
            now = time.perf_counter() - start
            pending += data
            *events, pending = pending.split(b"\n\n")
            for event in events:
                line = event.decode().strip()
                if not line.startswith("data: "):
                    continue
                text = line[len("data: "):]
                if text == "[DONE]":
                    finished = True
                    break
                message = json.loads(text)
                if "error" in message:
                    result.error = str(message["error"])[:300]
                    return
                if message.get("usage"):
                    result.output_tokens = int(message["usage"]["completion_tokens"])
                if any(choice.get("text") for choice in message.get("choices", [])):
                    result.first_text_s = now if result.first_text_s is None else result.first_text_s
                    result.chunk_times_s.append(now)
        result.done_s = time.perf_counter() - start
        if not finished:
            result.error = "the stream ended without data: [DONE]"
        elif result.output_tokens != body["max_tokens"]:
            result.error = f"{result.output_tokens} tokens of the {body['max_tokens']} asked"
    except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as error:
        result.error = f"{type(error).__name__}: {error}"
    finally:
        if writer is not None:
            writer.close()


def run_rate(url: str, model: str, api_key: str | None, workload: Workload, arrivals_s: np.ndarray
             ) -> dict[str, Any]:
    """Sends the workload at ``arrivals_s`` and measures it (module docstring)."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    results = [RequestResult() for _ in workload.prompts]

    async def run() -> None:
        start = time.perf_counter()
        tasks = []
        for i, (prompt, params) in enumerate(zip(workload.prompts, workload.params)):
            body = {"model": model, "prompt": prompt, "max_tokens": params.max_tokens, "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            delay = arrivals_s[i] - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(stream_completion(url, body, headers, start, results[i])))
        await asyncio.gather(*tasks)

    asyncio.run(run())
    return summarize(workload, results)


def server_compilations(url: str, api_key: str | None) -> int | None:
    """The server's ``jax_paged_attn:xla_compilations_total`` (None where it has none)."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=30)
    try:
        connection.request("GET", "/metrics", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        response = connection.getresponse()
        text = response.read().decode(errors="replace") if response.status == 200 else ""
    except (OSError, http.client.HTTPException):
        return None
    finally:
        connection.close()
    for line in text.splitlines():
        if line.startswith("jax_paged_attn:xla_compilations_total"):
            return int(float(line.rsplit(" ", 1)[1]))
    return None


def wait_ready(url: str, api_key: str | None, limit_s: float, started_at: float) -> dict[str, float]:
    """Seconds from ``started_at`` (epoch s) to ``/health``'s first 200 and to one served
    one-token completion (module docstring); SystemExit after ``limit_s`` without a 200."""
    parts = urllib.parse.urlsplit(url)
    deadline = time.time() + limit_s
    while True:
        try:
            connection = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=10)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                break
        except (OSError, http.client.HTTPException):
            pass
        finally:
            connection.close()
        if time.time() > deadline:
            raise SystemExit(f"{url}/health did not answer 200 within {limit_s:.0f} s")
        time.sleep(0.1)
    ready_s = time.time() - started_at
    model = _first_model(url, api_key)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    connection = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=300)
    connection.request("POST", "/v1/completions", json.dumps({"model": model, "prompt": [1, 2, 3], "max_tokens": 1,
                                                              "temperature": 0.0}), headers)
    response = connection.getresponse()
    body = response.read()
    connection.close()
    if response.status != 200:
        raise SystemExit(f"the first completion answered {response.status}: {body[:300]!r}")
    served_s = time.time() - started_at
    print(f"server start: /health 200 after {ready_s:.2f} s, first request served after {served_s:.2f} s "
          f"(from the process's start), model {model}")
    return dict(ready_s=ready_s, first_served_s=served_s)


def summarize(workload: Workload, results: list[RequestResult]) -> dict[str, Any]:
    """vLLM's serving metrics of one run's ``results`` (module docstring)."""
    good = [(r, p) for r, p in zip(results, workload.prompts) if r.error is None]
    duration = max((r.done_s for r, _ in good), default=0.0) - min((r.sent_s for r in results), default=0.0)
    output_tokens = sum(r.output_tokens for r, _ in good)
    prompt_tokens = sum(len(p) for _, p in good)
    ttft = [1e3 * (r.first_text_s - r.sent_s) for r, _ in good if r.first_text_s is not None]
    latency = [1e3 * (r.done_s - r.sent_s) for r, _ in good]
    tpot = [1e3 * (r.done_s - r.first_text_s) / (r.output_tokens - 1) for r, _ in good
            if r.first_text_s is not None and r.output_tokens > 1]
    itl = [1e3 * gap for r, _ in good for gap in np.diff(r.chunk_times_s)]
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: float("nan"))
    return dict(requests=len(results), failed=len(results) - len(good),
                errors=sorted({r.error for r in results if r.error})[:5], duration_s=duration,
                request_rate=per_s(len(good)), output_tok_s=per_s(output_tokens),
                total_tok_s=per_s(output_tokens + prompt_tokens), ttft_ms=percentiles(ttft),
                tpot_ms=percentiles(tpot), itl_ms=percentiles(itl), latency_ms=percentiles(latency))


def markdown(rows: list[tuple[str, dict[str, Any]]]) -> str:
    """One table row per rate."""
    def p(values: list[float]) -> str:
        return " / ".join(f"{v:.1f}" for v in values)

    lines = ["| rate | requests | failed | duration s | req/s | output tok/s | total tok/s | TTFT ms p50 / p90 / p99 "
             "| TPOT ms | ITL ms | latency ms | compiles while serving |", "| --- " * 12 + "|"]
    for rate, r in rows:
        lines.append(f"| {rate} | {r['requests']} | {r['failed']} | {r['duration_s']:.2f} | {r['request_rate']:.2f} "
                     f"| {r['output_tok_s']:,.0f} | {r['total_tok_s']:,.0f} | {p(r['ttft_ms'])} | {p(r['tpot_ms'])} "
                     f"| {p(r['itl_ms'])} | {p(r['latency_ms'])} | {'n/a' if r.get('compiles') is None else r['compiles']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[tuple[str, dict[str, Any]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="the server's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--write-checkpoint", type=pathlib.Path, default=None, metavar="DIR",
                        help="save the benchmark model and a tokenizer for the server to load, then exit")
    parser.add_argument("--quick", action="store_true", help="with --write-checkpoint: the tiny model")
    parser.add_argument("--model", default=None, help="the served model name (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--rates", default="inf", help="inf, requests/s, or Fx (F times the inf run's rate)")
    parser.add_argument("--prompt-lens", type=length_range, default=(32, 2048))
    parser.add_argument("--output-lens", type=length_range, default=(16, 512))
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=pathlib.Path, default=None, help="also write the results here")
    parser.add_argument("--wait-ready", type=float, default=None, metavar="S",
                        help="only wait (at most S s) for the server and time its start-up (module docstring)")
    parser.add_argument("--started-at", type=float, default=None, metavar="EPOCH_S",
                        help="with --wait-ready: when the server process started (default: now)")
    args = parser.parse_args(argv)
    started_at = time.time() if args.started_at is None else args.started_at
    if args.write_checkpoint is not None:
        args.write_checkpoint.mkdir(parents=True, exist_ok=True)
        write_checkpoint(args.write_checkpoint, args.quick)
        return []
    if args.url is None:
        parser.error("--url is required (or --write-checkpoint DIR)")
    if args.wait_ready is not None:
        timings = wait_ready(args.url, args.api_key, args.wait_ready, started_at)
        return [("start-up", timings)]
    if args.num_requests < 1:
        parser.error(f"--num-requests must be >= 1, got {args.num_requests}")
    try:
        rates = parse_rates(args.rates)
    except ValueError as error:
        parser.error(str(error))
    model = args.model or _first_model(args.url, args.api_key)
    workload = make_workload(args.num_requests, args.vocab_size, args.prompt_lens, args.output_lens, args.seed)
    rows: list[tuple[str, dict[str, Any]]] = []
    saturation = None
    for rate in rates:
        value = rate_value(rate, saturation)
        compiles_before = server_compilations(args.url, args.api_key)
        result = run_rate(args.url, model, args.api_key, workload, poisson_arrivals(args.num_requests, value, args.seed))
        compiles_after = server_compilations(args.url, args.api_key)
        result["compiles"] = None if compiles_before is None or compiles_after is None else compiles_after - compiles_before
        if rate == "inf":
            saturation = result["request_rate"]
        rows.append((rate if value == float("inf") else f"{rate} ({value:.2f} req/s)", result))
        print(markdown(rows[-1:]), flush=True)
    print(f"\n# HTTP serving, {args.url}, model {model}, {args.num_requests} requests\n")
    print(markdown(rows))
    if args.json is not None:
        args.json.write_text(json.dumps([dict(rate=rate, **r) for rate, r in rows], indent=1))
    return rows


def write_checkpoint(directory: pathlib.Path, quick: bool) -> None:
    """The offline benchmark's model as a checkpoint directory the server loads (module
    docstring)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from jax_paged_attn.models import save_checkpoint

    model, _ = build_model(quick)
    save_checkpoint(model, model.config, directory)
    vocab = {f"w{i}": i for i in range(model.config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    print(f"wrote {directory}: {model.config.vocab_size} token ids, {np.dtype(model.dtype).name} weights")


def _first_model(url: str, api_key: str | None) -> str:
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=30)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connection.request("GET", "/v1/models", headers=headers)
    response = connection.getresponse()
    if response.status != 200:
        raise SystemExit(f"GET {url}/v1/models answered {response.status}: pass --model")
    return json.loads(response.read())["data"][0]["id"]


if __name__ == "__main__":
    main()
