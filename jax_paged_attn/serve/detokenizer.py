"""Incremental text of one generated sequence, for streaming: owns what text a sequence
may show so far and where a stop string ends it.

`SequenceText.update` takes the sequence's whole output ids after every engine step and
returns the text to send since the last call. While the sequence runs it decodes only the
new tokens with the `CONTEXT_TOKENS` before them (vLLM's incremental detokenization: the
context decodes the join of the pieces, a word-level space or a SentencePiece word start,
as the whole sequence would) and appends what follows the context's own text; a context
that decodes to nothing (skipped special tokens) decodes the sequence whole that step, and
a decoder whose pieces do not extend their context's text is decoded whole from then on. The finished sequence is
decoded whole, once, so the streamed pieces concatenate to exactly the text
`LLM.generate` returns for the same tokens. It holds back:

* a trailing U+FFFD: the bytes of a multi-byte character split over tokens, not yet
  complete (the next token completes it);
* a tail that could be the start of a stop string (``"Obs"`` of stop ``"Observation"``),
  so a stop string split over tokens never reaches the client.

Cost: two decodes of a step's tokens and their context per step and sequence, and one
of the whole sequence at its end (with stop strings, `find_stop` decodes the
whole sequence each step).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from jax_paged_attn.engine.llm import first_stop, stop_search_start

if TYPE_CHECKING:
    from tokenizers import Tokenizer

INCOMPLETE_CHARACTER = "\ufffd"
"""What ``tokenizers`` decodes an incomplete UTF-8 byte sequence to."""

CONTEXT_TOKENS = 6
"""Tokens decoded before a step's new ones, as their context (vLLM's initial offset is 5)."""


def stop_prefix_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


class SequenceText:
    """The text state of one sequence (see the module docstring).

    Args:
      tokenizer: the checkpoint's `tokenizers.Tokenizer`.
      stop: the request's stop strings (`SamplingParams.stop`).
      include_stop_str_in_output: keep a matched stop string, and the text of a stop
        token (EOS, ``stop_token_ids``) that ended the sequence (vLLM's rule).
      skip_special_tokens: leave special tokens out of the text.
      min_tokens: no stop string may end in the text of the first ``min_tokens`` tokens.

    ``sent``: characters returned so far; ``text``: the full text once finished.
    """

    def __init__(self, tokenizer: "Tokenizer", stop: Sequence[str], include_stop_str_in_output: bool,
                 skip_special_tokens: bool, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens
        self._protected: int | None = None  # characters of the first min_tokens tokens' text, once known
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.sent = 0
        self.text = ""
        self._num_clean_tokens = 0  # leading tokens whose text holds no stop string
        self._settled = ""  # the text of the tokens before _read_offset
        self._read_offset = 0
        self._decode_whole = False

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=self.skip_special_tokens)

    def find_stop(self, token_ids: Sequence[int]) -> tuple[int, str] | None:
        """``(tokens to keep, stop string)`` when the text of ``token_ids`` (all output
        ids so far) holds a stop string: the fewest leading tokens whose text holds one
        (the token that completed it is kept, as the engine's `stop_request` expects);
        None otherwise."""
        if not self.stop or len(token_ids) <= self.min_tokens:
            return None
        protected = self.protected_length(token_ids)
        if first_stop(self.decode(token_ids), self.stop, protected) is None:
            self._num_clean_tokens = len(token_ids)
            return None
        for num_tokens in range(max(self._num_clean_tokens, self.min_tokens) + 1, len(token_ids) + 1):
            found = first_stop(self.decode(token_ids[:num_tokens]), self.stop, protected)
            if found is not None:
                return num_tokens, found[1]
        raise AssertionError("the whole text holds a stop string, so some prefix does")

    def protected_length(self, token_ids: Sequence[int]) -> int:
        """Characters of the text of the first ``min_tokens`` of ``token_ids`` (at least
        that many), where no stop string may end."""
        if self._protected is None:
            self._protected = len(self.decode(token_ids[:self.min_tokens])) if self.min_tokens else 0
        return self._protected

    def update(self, token_ids: Sequence[int], finish_reason: str | None, stop_reason: int | str | None) -> str:
        """The new text since the last call, given every output id so far and the
        sequence's finish and stop reasons (None while it runs). Once finished, ``text``
        is the whole text: cut before a stop string (after it with
        ``include_stop_str_in_output``), without a stop token's text unless that flag."""
        if finish_reason is None:
            text = self._running_text(token_ids)
        else:
            ids = list(token_ids)
            stopped_by_token = finish_reason == "stop" and not isinstance(stop_reason, str)
            if stopped_by_token and ids and not self.include_stop_str_in_output:
                ids = ids[:-1]
            text = self.decode(ids)
        if finish_reason is not None:
            if isinstance(stop_reason, str):
                cut = text.find(stop_reason, stop_search_start(stop_reason, self.protected_length(ids)))
                assert cut >= 0, "a sequence stopped by a string keeps the tokens that hold it"
                text = text[:cut + len(stop_reason)] if self.include_stop_str_in_output else text[:cut]
            self.text = text
        else:
            visible = len(text.rstrip(INCOMPLETE_CHARACTER))
            text = text[:visible - stop_prefix_length(text[:visible], self.stop)]
        if len(text) <= self.sent:
            return ""
        new, self.sent = text[self.sent:], len(text)
        return new

    def _running_text(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` (every output id so far) by incremental decoding
        (module docstring)."""
        if self._decode_whole:
            return self.decode(token_ids)
        read = self._read_offset
        start = max(0, read - CONTEXT_TOKENS)
        context = self.decode(token_ids[start:read])
        tail = self.decode(token_ids[start:])
        if read and not context:
            # Context tokens that decode to nothing (special tokens skipped) join nothing:
            # the new tokens would decode as a sequence's first ones.
            text = self.decode(token_ids)
        elif not tail.startswith(context):  # pieces that do not extend their context
            self._decode_whole = True
            return self.decode(token_ids)
        else:
            text = self._settled + tail[len(context):]
        if not text.endswith(INCOMPLETE_CHARACTER):  # the next context starts on a whole character
            self._settled, self._read_offset = text, len(token_ids)
        return text
