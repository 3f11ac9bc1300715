"""OpenAI's request and response shapes: owns parsing a request body into the engine's
terms (`SamplingParams`, prompts) and building the JSON replies and stream chunks.

Parsing is by hand, not by a schema library, so every error is OpenAI's
(`ApiError`: ``{"error": {"message", "type", "param", "code"}}``) and names the field:
unknown fields are ignored (clients send more than the engine reads), ``null`` is the
default of every optional field, and a wrong type is a 400, never a coercion
(``"temperature": "0.5"`` is refused as OpenAI refuses it).

Parameters the engine cannot honour yet (`UNSUPPORTED_PARAMETERS`: ``echo``,
``suffix``, ``tools``, ``prompt_logprobs``, guided decoding) are accepted at their
neutral value and refused otherwise with a 400 naming them, never ignored. The
penalties, ``min_p``, ``min_tokens`` and ``logit_bias`` run on the device
(`jax_paged_attn.engine.penalties`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import time
import uuid
from typing import Any, Sequence

from jax_paged_attn.engine import Logprob, SamplingParams

UNSUPPORTED_PARAMETERS: dict[str, tuple[Any, ...]] = {
    "echo": (False,),
    "suffix": ("",),
    "tools": ([],),
    "prompt_logprobs": (0,),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
}
"""Parameters the engine does not implement yet, with the values that mean "off" (null
is always off): a request giving another value gets a 400."""

MIN_JSON_LOGPROB = -9999.0
"""JSON has no -inf: a token of probability 0 reports this logprob (vLLM's value)."""


class ApiError(Exception):
    """An error the client sees, in OpenAI's shape.

    Attributes: ``status`` (HTTP status), ``message``, ``type`` (OpenAI's error type,
    e.g. "invalid_request_error"), ``param`` (the request field at fault, or None),
    ``code`` (e.g. "model_not_found"), ``headers`` (extra HTTP headers, e.g. Retry-After).
    """

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


_NAMED_ARGUMENT = re.compile(r"^(?:sampling_params\.)?([a-z_]+)")


def from_validation_error(error: Exception, fields: dict[str, str] | None = None) -> ApiError:
    """A 400 from a `SamplingParams` / engine ValueError or TypeError, whose messages
    start with the argument's name (``"top_p must be in (0, 1], got 2"``); ``fields``
    renames an engine argument to the request's field (``{"prompt": "messages"}``)."""
    message = str(error)
    match = _NAMED_ARGUMENT.match(message)
    param = match.group(1) if match else None
    if fields and param in fields:
        param = fields[param]
    return bad_request(message, param=param)


# ---------------------------------------------------------------- field readers
_JSON_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
                    dict: "an object"}


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    for kind, name in _JSON_TYPE_NAMES.items():
        if type(value) is kind:
            return name
    return type(value).__name__


def optional(body: dict[str, Any], name: str, kinds: type | tuple[type, ...], default: Any = None) -> Any:
    """``body[name]`` if present and not null, else ``default``; a 400 naming ``name``
    when it is not of ``kinds`` (bool is never taken for a number)."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if isinstance(value, bool) and bool not in kinds:
        ok = False
    else:
        ok = isinstance(value, kinds)
    if not ok:
        expected = "a number" if set(kinds) == {int, float} else " or ".join(
            _JSON_TYPE_NAMES.get(k, k.__name__) for k in kinds)
        raise bad_request(f"{name} must be {expected}, got {_type_name(value)}: {value!r}.", param=name)
    if isinstance(value, float) and not math.isfinite(value):
        raise bad_request(f"{name} must be a finite number, got {value!r}.", param=name)
    return value


def required(body: dict[str, Any], name: str, kinds: type | tuple[type, ...]) -> Any:
    if body.get(name) is None:
        raise bad_request(f"{name} is required.", param=name)
    return optional(body, name, kinds)


def check_unsupported(body: dict[str, Any]) -> None:
    """A 400 for a parameter of `UNSUPPORTED_PARAMETERS` at a value other than off."""
    for name, neutral in UNSUPPORTED_PARAMETERS.items():
        value = body.get(name)
        if value is None or any(type(value) is type(n) and value == n for n in neutral) or \
                (isinstance(value, (int, float)) and not isinstance(value, bool) and value in neutral):
            continue
        off = f" or pass {json.dumps(neutral[-1])}" if neutral else ""
        raise bad_request(f"{name}={value!r} is not supported yet by this server (the engine does not implement it); "
                          f"omit it{off}.", param=name, code="unsupported_parameter")


def _stop_strings(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise bad_request(f"stop must be a string or an array of strings, got {stop!r}.", param="stop")


LOGIT_BIAS_LIMIT = 100.0
"""A ``logit_bias`` value is clamped to ``[-100, 100]`` (OpenAI's range, clamped as vLLM does)."""


def _logit_bias(body: dict[str, Any]) -> dict[int, float] | None:
    """``logit_bias`` as ``{token_id: bias}``: JSON keys are strings, so each must spell
    an integer; values are numbers, clamped to ±`LOGIT_BIAS_LIMIT`. The ids are checked
    against the vocabulary by the engine (a 400 naming ``logit_bias`` too)."""
    value = optional(body, "logit_bias", dict)
    if value is None:
        return None
    bias = {}
    for key, amount in value.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids (integers as strings), got {key!r}.",
                              param="logit_bias") from None
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not math.isfinite(amount):
            raise bad_request(f"logit_bias[{key!r}] must be a finite number, got {_type_name(amount)}: {amount!r}.",
                              param="logit_bias")
        bias[token] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(amount)))
    return bias


def sampling_params(body: dict[str, Any], *, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """`SamplingParams` from the fields OpenAI and vLLM share; ``max_tokens`` and
    ``logprobs`` come from the endpoint that reads them. The value checks of
    `SamplingParams` (every field's range, the random seed's included) become 400s
    naming the field."""
    fields: dict[str, Any] = dict(
        temperature=optional(body, "temperature", (int, float), 1.0),
        top_p=optional(body, "top_p", (int, float), 1.0),
        top_k=optional(body, "top_k", int, -1),
        n=optional(body, "n", int, 1),
        seed=optional(body, "seed", int),
        stop=_stop_strings(body),
        stop_token_ids=tuple(optional(body, "stop_token_ids", list, [])),
        ignore_eos=optional(body, "ignore_eos", bool, False),
        include_stop_str_in_output=optional(body, "include_stop_str_in_output", bool, False),
        skip_special_tokens=optional(body, "skip_special_tokens", bool, True),
        logprobs=logprobs,
        presence_penalty=optional(body, "presence_penalty", (int, float), 0.0),
        frequency_penalty=optional(body, "frequency_penalty", (int, float), 0.0),
        repetition_penalty=optional(body, "repetition_penalty", (int, float), 1.0),
        min_p=optional(body, "min_p", (int, float), 0.0),
        min_tokens=optional(body, "min_tokens", int, 0),
        logit_bias=_logit_bias(body),
    )
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    best_of = optional(body, "best_of", int)
    if best_of is not None and best_of != fields["n"]:
        raise bad_request(f"best_of={best_of} (other than n) is not supported yet by this server.", param="best_of",
                          code="unsupported_parameter")
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as e:
        raise from_validation_error(e) from None


def stream_options(body: dict[str, Any], stream: bool) -> bool:
    """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
    options = optional(body, "stream_options", dict, {})
    if options and not stream:
        raise bad_request("stream_options is only allowed with stream=true.", param="stream_options")
    return bool(optional(options, "include_usage", bool, False))


# ---------------------------------------------------------------- requests
Prompt = list[int]


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    """``POST /v1/completions``. ``prompts``: one or more prompts, each a text or token
    ids (OpenAI's four forms); ``logprobs``: top logprobs per token or None."""

    model: str | None
    prompts: list[str | Prompt]
    max_tokens: int
    logprobs: int | None
    stream: bool
    include_usage: bool
    body: dict[str, Any]


def _prompts(value: Any) -> list[str | Prompt]:
    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(value, str):
        return [value]
    if is_ids(value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(p, str) or is_ids(p) for p in value):
        return list(value)
    raise bad_request("prompt must be a non-empty string, an array of strings, an array of token ids or an array "
                      f"of token-id arrays, got {_type_name(value)}: {str(value)[:100]!r}.", param="prompt")


def parse_completion_request(body: dict[str, Any]) -> CompletionRequest:
    check_unsupported(body)
    stream = optional(body, "stream", bool, False)
    return CompletionRequest(
        model=optional(body, "model", str),
        prompts=_prompts(required(body, "prompt", (str, list))),
        max_tokens=optional(body, "max_tokens", int, 16),
        logprobs=optional(body, "logprobs", int),
        stream=stream, include_usage=stream_options(body, stream), body=body)


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """``POST /v1/chat/completions``. ``messages``: ``[{"role", "content"}]`` with text
    content (a string, or text parts joined); ``max_tokens``: None = up to the context;
    ``top_logprobs``: per token, with ``logprobs`` true, else None."""

    model: str | None
    messages: list[dict[str, Any]]
    max_tokens: int | None
    top_logprobs: int | None
    add_generation_prompt: bool
    stream: bool
    include_usage: bool
    body: dict[str, Any]


def _message(message: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise bad_request(f"{where} must be an object with 'role' and 'content', got {_type_name(message)}.",
                          param="messages")
    role = message.get("role")
    if not isinstance(role, str):
        raise bad_request(f"{where}.role must be a string, got {_type_name(role)}.", param="messages")
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content[{j}] must be a text part {{'type': 'text', 'text': ...}}; "
                                  f"this server takes text only.", param="messages")
            texts.append(part["text"])
        content = "".join(texts)
    elif content is not None and not isinstance(content, str):
        raise bad_request(f"{where}.content must be a string or an array of text parts, got {_type_name(content)}.",
                          param="messages")
    return {**message, "content": content}


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    check_unsupported(body)
    messages = required(body, "messages", list)
    if not messages:
        raise bad_request("messages must hold at least one message.", param="messages")
    stream = optional(body, "stream", bool, False)
    max_tokens = optional(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = optional(body, "max_tokens", int)
    want_logprobs = optional(body, "logprobs", bool, False)
    top_logprobs = optional(body, "top_logprobs", int)
    if top_logprobs is not None and not want_logprobs:
        raise bad_request("top_logprobs needs logprobs=true.", param="top_logprobs")
    return ChatRequest(
        model=optional(body, "model", str),
        messages=[_message(m, i) for i, m in enumerate(messages)],
        max_tokens=max_tokens,
        top_logprobs=(top_logprobs or 0) if want_logprobs else None,
        add_generation_prompt=optional(body, "add_generation_prompt", bool, True),
        stream=stream, include_usage=stream_options(body, stream), body=body)


# ---------------------------------------------------------------- replies
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _json_logprob(value: float) -> float:
    return max(value, MIN_JSON_LOGPROB) if not math.isnan(value) else MIN_JSON_LOGPROB


class TokenText:
    """Each token's text for logprobs (special tokens shown, as vLLM shows them), cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        if token not in self._text:
            self._text[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return self._text[token]


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]], num_top: int,
                        token_text: TokenText, text_offset: int) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (the top ``num_top`` of each position, token text -> logprob) and
    ``text_offset`` (each token's start in the choice's text, from ``text_offset``)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token, entry in zip(token_ids, logprobs):
        text = token_text(token)
        tokens.append(text)
        token_logprobs.append(_json_logprob(entry[token].logprob))
        top = list(entry.items())[:num_top]
        tops.append({token_text(t): _json_logprob(lp.logprob) for t, lp in top} if num_top else None)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]], num_top: int,
                  token_text: TokenText) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [{"token", "logprob", "bytes",
    "top_logprobs": [{"token", "logprob", "bytes"}]}]}``."""
    def item(token: int, lp: Logprob) -> dict[str, Any]:
        text = token_text(token)
        return {"token": text, "logprob": _json_logprob(lp.logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [
        {**item(token, entry[token]), "top_logprobs": [item(t, lp) for t, lp in list(entry.items())[:num_top]]}
        for token, entry in zip(token_ids, logprobs)]}


def completion_choice(index: int, text: str, finish_reason: str | None, stop_reason: int | str | None,
                      logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def envelope(object_name: str, request_id: str, model: str, created: int | None = None, **fields: Any
             ) -> dict[str, Any]:
    """The fields every reply and chunk share: ``id``, ``object``, ``created``, ``model``."""
    return {"id": request_id, "object": object_name, "created": int(time.time()) if created is None else created,
            "model": model, **fields}
