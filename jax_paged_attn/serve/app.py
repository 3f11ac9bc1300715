"""The HTTP routes (FastAPI): owns turning requests into `AsyncEngine` calls and its
streams into OpenAI replies, Server-Sent Events, errors and the API key check.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``.

Every error is OpenAI's shape (`ApiError`); an unexpected exception is logged and
answered with a generic 500, never a stack trace. A client that disconnects (streaming
or not) aborts its request. With an API key, the ``/v1`` routes and the tokenizer
routes need ``Authorization: Bearer KEY`` (401 otherwise); ``/health`` and
``/metrics`` stay open for probes and scrapers.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from jax_paged_attn.engine import SamplingParams
from jax_paged_attn.serve import protocol
from jax_paged_attn.serve.async_engine import AsyncEngine, EngineError, RequestAborted, RequestStream, SequenceDelta
from jax_paged_attn.serve.chat_template import ChatTemplate, ChatTemplateError
from jax_paged_attn.serve.protocol import ApiError, bad_request

logger = logging.getLogger(__name__)

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


def _error_response(error: ApiError) -> Any:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


INTERNAL_ERROR = ApiError(500, "internal server error; the request was aborted (the server log has the cause).",
                          type="internal_server_error")


class ApiKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which would buffer streams and hide client
    disconnects): 401 in OpenAI's shape unless the bearer token is the key."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = ApiError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'.",
                                 type="authentication_error", code="invalid_api_key")
                await _error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _json_body(request: Any) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}.")
    return body


async def _wait_for_disconnect(request: Any) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@contextlib.asynccontextmanager
async def _aborted_on_disconnect(request: Any, stream: RequestStream) -> AsyncIterator[None]:
    """Aborts ``stream`` when the client disconnects, and when the block exits early
    (an error, a cancellation: uvicorn cancels handlers at its shutdown timeout)."""
    async def watch() -> None:
        await _wait_for_disconnect(request)
        stream.abort()

    watcher = asyncio.ensure_future(watch())
    try:
        yield
    finally:
        watcher.cancel()
        stream.abort()


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class _Server:
    """The routes' shared state: the front end, names, template."""

    def __init__(self, front: AsyncEngine, model_name: str, model_root: str, chat_template: ChatTemplate | None):
        self.front = front
        self.model_name = model_name
        self.model_root = model_root
        self.chat_template = chat_template
        self.created = int(time.time())
        self.token_text = protocol.TokenText(front.tokenizer)

    # ---------------------------------------------------------------- checks
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}.",
                           param="model", code="model_not_found")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.front.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def check_length(self, prompt: list[int], max_tokens: int | None, field: str) -> int:
        """``max_tokens``, or what the context leaves when None; a 400 when the prompt
        and ``max_tokens`` do not fit in ``max_model_len`` (vLLM's message)."""
        limit = self.front.max_model_len
        if not prompt:
            raise bad_request(f"{field} is empty; a prompt needs at least one token.", param=field)
        if len(prompt) >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, your {field} has "
                              f"{len(prompt)} tokens, which leaves no room for a completion; shorten it.",
                              param=field, code="context_length_exceeded")
        if max_tokens is None:
            return limit - len(prompt)
        if len(prompt) + max_tokens > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the {field}, {max_tokens} in "
                              f"the completion). Please reduce the length of the {field} or completion.",
                              param="max_tokens", code="context_length_exceeded")
        return max_tokens

    async def start(self, prompts: list[list[int]], params: SamplingParams, field: str) -> RequestStream:
        try:
            return await self.front.generate(prompts, params)
        except (ValueError, TypeError) as e:
            # The engine's messages name its arguments; "request ... may reach N tokens" is
            # a max_tokens the KV cache could never hold.
            raise protocol.from_validation_error(
                e, {"prompt_token_ids": field, "prompt": field, "request": "max_tokens"}) from None

    async def collect(self, request: Any, stream: RequestStream) -> list[list[SequenceDelta]]:
        """Every delta of every sequence, by choice index (a non-streaming reply)."""
        choices: list[list[SequenceDelta]] = [[] for _ in range(stream.num_sequences)]
        async with _aborted_on_disconnect(request, stream):
            async for deltas in stream:
                for d in deltas:
                    choices[d.index].append(d)
        return choices

    def logprobs_of(self, deltas: list[SequenceDelta]) -> tuple[list[int], list[dict]] | None:
        if deltas and deltas[0].logprobs is None:
            return None
        return ([t for d in deltas for t in d.token_ids], [lp for d in deltas for lp in (d.logprobs or [])])

    # ---------------------------------------------------------------- completions
    async def completions(self, request: Any) -> Any:
        req = protocol.parse_completion_request(await _json_body(request))
        self.check_model(req.model)
        prompts = []
        for i, p in enumerate(req.prompts):
            ids = self.encode(p) if isinstance(p, str) else p
            field = "prompt" if len(req.prompts) == 1 else f"prompt[{i}]"
            self.check_length(ids, req.max_tokens, field)
            prompts.append(ids)
        params = protocol.sampling_params(req.body, max_tokens=req.max_tokens, logprobs=req.logprobs)
        stream = await self.start(prompts, params, "prompt")
        request_id, created = protocol.new_id("cmpl"), int(time.time())
        num_prompt_tokens = params.n * sum(len(p) for p in prompts)

        def logprobs(ids: list[int], lps: list[dict] | None, offset: int) -> dict | None:
            if lps is None:
                return None
            return protocol.completion_logprobs(ids, lps, req.logprobs, self.token_text, offset)

        if not req.stream:
            choices, num_tokens = [], 0
            for index, deltas in enumerate(await self.collect(request, stream)):
                last = deltas[-1]
                got = self.logprobs_of(deltas)
                choices.append(protocol.completion_choice(
                    index, "".join(d.text for d in deltas), last.finish_reason, last.stop_reason,
                    None if got is None else logprobs(*got, 0)))
                num_tokens += last.num_tokens
            return JSONResponse(protocol.envelope("text_completion", request_id, self.model_name, created,
                                                  choices=choices, usage=protocol.usage(num_prompt_tokens, num_tokens)))

        async def events() -> AsyncIterator[str]:
            offsets = [0] * stream.num_sequences
            num_tokens = [0] * stream.num_sequences
            async for chunk in self._stream_events(request, stream, num_tokens):
                choices = []
                for d in chunk:
                    if not d.text and d.finish_reason is None and not (d.logprobs and d.token_ids):
                        continue
                    choices.append(protocol.completion_choice(
                        d.index, d.text, d.finish_reason, d.stop_reason,
                        logprobs(d.token_ids, d.logprobs, offsets[d.index])))
                    offsets[d.index] += len(d.text)
                if choices:
                    yield _sse(protocol.envelope("text_completion", request_id, self.model_name, created,
                                                 choices=choices))
            if req.include_usage:
                yield _sse(protocol.envelope("text_completion", request_id, self.model_name, created, choices=[],
                                             usage=protocol.usage(num_prompt_tokens, sum(num_tokens))))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _stream_events(self, request: Any, stream: RequestStream, num_tokens: list[int]
                             ) -> AsyncIterator[list[SequenceDelta]]:
        """The stream's deltas, counting each choice's tokens; an engine failure becomes
        an error event (the status line is already sent)."""
        async with _aborted_on_disconnect(request, stream):
            try:
                async for deltas in stream:
                    for d in deltas:
                        num_tokens[d.index] = d.num_tokens
                    yield deltas
            except EngineError:
                raise _StreamError(INTERNAL_ERROR) from None
            except RequestAborted:
                raise _StreamError(ApiError(503, "the request was aborted: the server is shutting down.",
                                            type="service_unavailable")) from None

    # ---------------------------------------------------------------- chat
    async def chat(self, request: Any) -> Any:
        req = protocol.parse_chat_request(await _json_body(request))
        self.check_model(req.model)
        if self.chat_template is None:
            raise bad_request(f"the model {self.model_name!r} has no chat template (no chat_template in its "
                              f"tokenizer_config.json, no chat_template.jinja): use /v1/completions.",
                              code="no_chat_template")
        try:
            text = self.chat_template.render(req.messages, add_generation_prompt=req.add_generation_prompt)
        except ChatTemplateError as e:
            raise bad_request(str(e), param="messages") from None
        prompt = self.encode(text, add_special_tokens=False)  # the template holds its special tokens
        max_tokens = self.check_length(prompt, req.max_tokens, "messages")
        params = protocol.sampling_params(req.body, max_tokens=max_tokens, logprobs=req.top_logprobs)
        stream = await self.start([prompt], params, "messages")
        request_id, created = protocol.new_id("chatcmpl"), int(time.time())
        num_prompt_tokens = params.n * len(prompt)

        def logprobs(ids: list[int], lps: list[dict] | None) -> dict | None:
            return None if lps is None else protocol.chat_logprobs(ids, lps, req.top_logprobs, self.token_text)

        if not req.stream:
            choices, num_tokens = [], 0
            for index, deltas in enumerate(await self.collect(request, stream)):
                last = deltas[-1]
                got = self.logprobs_of(deltas)
                choices.append({"index": index,
                                "message": {"role": "assistant", "content": "".join(d.text for d in deltas)},
                                "logprobs": None if got is None else logprobs(*got),
                                "finish_reason": last.finish_reason, "stop_reason": last.stop_reason})
                num_tokens += last.num_tokens
            return JSONResponse(protocol.envelope("chat.completion", request_id, self.model_name, created,
                                                  choices=choices, usage=protocol.usage(num_prompt_tokens, num_tokens)))

        async def events() -> AsyncIterator[str]:
            num_tokens = [0] * stream.num_sequences
            role_sent = [False] * stream.num_sequences
            async for chunk in self._stream_events(request, stream, num_tokens):
                choices = []
                for d in chunk:
                    if not d.text and d.finish_reason is None and not (d.logprobs and d.token_ids):
                        continue
                    delta: dict[str, Any] = {"content": d.text}
                    if not role_sent[d.index]:  # OpenAI's first delta of a choice names the role
                        delta = {"role": "assistant", **delta}
                        role_sent[d.index] = True
                    choices.append({"index": d.index, "delta": delta, "logprobs": logprobs(d.token_ids, d.logprobs),
                                    "finish_reason": d.finish_reason, "stop_reason": d.stop_reason})
                if choices:
                    yield _sse(protocol.envelope("chat.completion.chunk", request_id, self.model_name, created,
                                                 choices=choices))
            if req.include_usage:
                yield _sse(protocol.envelope("chat.completion.chunk", request_id, self.model_name, created,
                                             choices=[], usage=protocol.usage(num_prompt_tokens, sum(num_tokens))))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    # ---------------------------------------------------------------- the rest
    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "jax_paged_attn",
            "root": self.model_root, "parent": None, "max_model_len": self.front.max_model_len}]}

    async def tokenize(self, request: Any) -> dict[str, Any]:
        body = await _json_body(request)
        self.check_model(protocol.optional(body, "model", str))
        if body.get("messages") is not None:
            if self.chat_template is None:
                raise bad_request("this model has no chat template; tokenize a prompt instead.", param="messages")
            chat = protocol.parse_chat_request(body)
            try:
                text = self.chat_template.render(chat.messages, add_generation_prompt=chat.add_generation_prompt)
            except ChatTemplateError as e:
                raise bad_request(str(e), param="messages") from None
            tokens = self.encode(text, add_special_tokens=False)
        else:
            text = protocol.required(body, "prompt", str)
            tokens = self.encode(text, protocol.optional(body, "add_special_tokens", bool, True))
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.front.max_model_len}

    async def detokenize(self, request: Any) -> dict[str, Any]:
        body = await _json_body(request)
        self.check_model(protocol.optional(body, "model", str))
        tokens = protocol.required(body, "tokens", list)
        vocab = self.front.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens):
            raise bad_request(f"tokens must be an array of token ids in [0, {vocab}).", param="tokens")
        return {"prompt": self.front.tokenizer.decode(tokens, skip_special_tokens=False)}


class _StreamError(Exception):
    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


def _with_stream_errors(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream whose failure after the status line ends with an error event and [DONE]."""
    async def wrapped() -> AsyncIterator[str]:
        try:
            async for item in events:
                yield item
        except _StreamError as e:
            yield _sse(e.error.body())
            yield "data: [DONE]\n\n"
        except Exception:
            logger.exception("serve: a stream failed")
            yield _sse(INTERNAL_ERROR.body())
            yield "data: [DONE]\n\n"

    return wrapped()


def build_app(front: AsyncEngine, *, model_name: str, model_root: str, chat_template: ChatTemplate | None,
              api_key: str | None = None) -> Any:
    """The FastAPI application serving ``front`` (see the module docstring). Its
    lifespan starts the engine core and, at shutdown, aborts what still runs."""
    server = _Server(front, model_name, model_root, chat_template)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        front.start()
        yield
        await front.stop()

    app = FastAPI(title="jax_paged_attn OpenAI-compatible server", lifespan=lifespan)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(ApiError)
    async def api_error(_: Any, error: ApiError) -> Any:
        return _error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(_: Any, error: HTTPException) -> Any:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return _error_response(ApiError(error.status_code, str(error.detail), type=kind))

    @app.exception_handler(Exception)
    async def internal_error(_: Any, error: Exception) -> Any:
        logger.error("serve: unexpected error", exc_info=error)
        return _error_response(INTERNAL_ERROR)

    def streamed(response: Any) -> Any:
        if isinstance(response, StreamingResponse):
            response.body_iterator = _with_stream_errors(response.body_iterator)
        return response

    async def guarded(handler: Any, request: Request) -> Any:
        try:
            return streamed(await handler(request))
        except EngineError:
            return _error_response(INTERNAL_ERROR)
        except RequestAborted:
            return _error_response(ApiError(503, "the request was aborted: the server is shutting down.",
                                            type="service_unavailable"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await guarded(server.completions, request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await guarded(server.chat, request)

    @app.get("/v1/models")
    async def models() -> Any:
        return server.models()

    @app.get("/health")
    async def health() -> Any:
        if not front.accepting:
            return _error_response(ApiError(503, "shutting down", type="service_unavailable"))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Any:
        return PlainTextResponse(front.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        return await server.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Any:
        return await server.detokenize(request)

    return app
