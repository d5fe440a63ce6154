"""Incremental (streaming) detokenization: token ids in, append-only text deltas out.

Algorithm: the prefix_offset / read_offset window of Hugging Face TGI's `decode_token`
(text-generation-inference, server/text_generation_server/models/model.py) and vLLM's
`detokenize_incrementally` (vllm/transformers_utils/detokenizer_utils.py), the same idea as
`tokenizers.decoders.DecodeStream`. Decoding a token on its own loses context (SentencePiece
drops a leading space, byte-level BPE splits a multi-byte character over several tokens), so
we decode a small window twice -- ids[prefix_offset:read_offset] (already emitted) and
ids[prefix_offset:] -- and emit the difference, unless the longer decode ends in U+FFFD (an
incomplete UTF-8 sequence), in which case the tokens are held back until the character is
complete. Each emission slides the window forward, so work per token is amortised O(1).

One addition over TGI/vLLM keeps the window bounded when the ids are *invalid* UTF-8 (or
produce no text, e.g. skipped special tokens): once more than `MAX_PENDING` tokens are held,
we emit the longest prefix that later tokens can no longer change (see `_force_progress`).
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context (vLLM: INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes and every token yields >= 1 byte, so a valid stream
# never holds back more than 3 tokens; more than this means invalid bytes or empty-text tokens.
MAX_PENDING = 8
_MAX_INCOMPLETE_BYTES = 3  # the longest incomplete UTF-8 tail (lead byte + 2 continuations)


class IncrementalDetokenizer:
    """Turns one request's generated token ids into streamed text deltas.

    `tokenizer` is a Hugging Face tokenizer (anything with `decode(ids, skip_special_tokens=,
    clean_up_tokenization_spaces=)`). `prompt_token_ids` is used only as left context, so the
    first generated token's leading space decodes the way it does after the prompt. Deltas
    only ever append; `text` is their concatenation. Decoding never cleans up tokenization
    spaces (that rewrite is not prefix-stable); compare against `decode(...,
    clean_up_tokenization_spaces=False)`.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids or [])[-PROMPT_CONTEXT_TOKENS:]
        self._n_context = len(context)
        self._ids: list[int] = context  # context + generated; only the window is ever decoded
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._chunks: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        """The generated token ids (prompt context excluded)."""
        return self._ids[self._n_context :]

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of every returned delta)."""
        return "".join(self._chunks)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(
            self._ids[start:end],
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _emit(self, delta: str, new_read_offset: int) -> str:
        self._prefix_offset, self._read_offset = self._read_offset, new_read_offset
        if delta:
            self._chunks.append(delta)
        return delta

    def add_tokens(self, token_ids: list[int]) -> str:
        """Appends newly generated ids; returns the text they complete ("" if held back)."""
        self._ids.extend(token_ids)
        out: list[str] = []
        # Step one token at a time so each window (and each decode) stays small.
        for end in range(len(self._ids) - len(token_ids) + 1, len(self._ids) + 1):
            out.append(self._step(end))
        return "".join(out)

    def _step(self, end: int) -> str:
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, end)
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            return self._emit(new_text[len(prefix_text) :], end)
        if end - self._read_offset > MAX_PENDING:
            return self._force_progress(prefix_text, new_text, end)
        return ""

    def _force_progress(self, prefix_text: str, new_text: str, end: int) -> str:
        """Emits the longest held-back prefix that no later token can change.

        Text up to token j is settled if j is a clean cut (decoding both sides separately
        gives the same text, so no UTF-8 sequence, valid or not, straddles j) and at least
        `_MAX_INCOMPLETE_BYTES` tokens (hence bytes) follow j: by then any sequence started
        before j is complete or definitely invalid, so later tokens cannot change it.
        """
        for j in range(end - _MAX_INCOMPLETE_BYTES, self._read_offset, -1):
            text_j = self._decode(self._prefix_offset, j)
            if len(text_j) >= len(prefix_text) and text_j + self._decode(j, end) == new_text:
                return self._emit(text_j[len(prefix_text) :], j)
        return ""

    def flush(self) -> str:
        """Emits whatever is held back; call once when the request ends.

        The held-back text may contain U+FFFD when the ids themselves are invalid UTF-8 (e.g. a
        lone byte token, or a character cut off by max_tokens).
        """
        end = len(self._ids)
        if end == self._read_offset:
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, end)
        return self._emit(new_text[len(prefix_text) :], end)
