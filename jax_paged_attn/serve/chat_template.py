"""The checkpoint's chat template: owns finding it and rendering messages into a prompt
as transformers' ``apply_chat_template`` does (vLLM renders through transformers).

The template is tokenizer_config.json's ``chat_template`` (a string, or a list of
``{"name", "template"}`` of which "default" is taken) or, as newer transformers saves
it, a ``chat_template.jinja`` file beside it. Rendering follows transformers: a jinja2
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the loop
controls extension, a ``tojson`` filter that keeps non-ASCII text, ``raise_exception``
and ``strftime_now`` as globals, and the config's special tokens (``bos_token``,
``eos_token``, ...) in the context. The rendered text already holds the template's
special tokens, so it is tokenized without adding any (transformers' and vLLM's rule).
"""
from __future__ import annotations

import datetime
import json
import os
from typing import Any

TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template raised (``raise_exception``) or failed to render these messages."""


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken as transformers saves it
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A compiled chat template and the special tokens its context holds.

    Args:
      source: the jinja2 template text.
      special_tokens: ``{"bos_token": "<s>", ...}`` (from tokenizer_config.json).
    """

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        from jinja2 import ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(message)

        def tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
            return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)

        def strftime_now(fmt: str) -> str:
            return datetime.datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        self.source = source
        self.special_tokens = dict(special_tokens)
        self._template = env.from_string(source)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text of ``messages`` (``[{"role", "content"}, ...]``). Raises
        `ChatTemplateError` with the template's message when it refuses them."""
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens, **kwargs)
        except ChatTemplateError:
            raise
        except Exception as e:  # jinja2's errors: undefined names, sandbox violations, type errors
            raise ChatTemplateError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from e


def load_chat_template(model_dir: str | os.PathLike) -> ChatTemplate | None:
    """``model_dir``'s chat template, or None when it has none (see the module docstring).
    ValueError for a tokenizer_config.json that is not JSON or a template list without a
    "default" entry."""
    model_dir = os.fspath(model_dir)
    config: dict[str, Any] = {}
    config_file = os.path.join(model_dir, TOKENIZER_CONFIG)
    if os.path.isfile(config_file):
        with open(config_file, encoding="utf-8") as f:
            try:
                config = json.load(f)
            except ValueError as e:
                raise ValueError(f"{config_file} is not valid JSON: {e}") from e
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"{config_file}: chat_template lists templates {sorted(map(str, named))} but none "
                             f"named 'default'.")
        source = named["default"]
    template_file = os.path.join(model_dir, TEMPLATE_FILE)
    if source is None and os.path.isfile(template_file):
        with open(template_file, encoding="utf-8") as f:
            source = f.read()
    if source is None:
        return None
    if not isinstance(source, str):
        raise ValueError(f"{config_file}: chat_template must be a string, got {type(source).__name__}.")
    special = {key: _token_text(config.get(key)) for key in _SPECIAL_TOKEN_KEYS}
    return ChatTemplate(source, {k: v for k, v in special.items() if v is not None})
