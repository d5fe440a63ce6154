"""One request's output text: incremental detokenization followed by stop strings.

Tokens are fed one at a time so a stop string is caught at the exact token that completes it:
the tokens after it are dropped (not counted, not streamed) and the caller cancels the decode.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.tokenizer import Tokenizer
from services.router.flow.stop import StopStringMatcher


@dataclass
class TextDelta:
    """What one batch of new tokens adds to the stream."""

    token_ids: list[int]
    """The accepted tokens (all of them unless a stop string matched part-way)."""
    text: str
    """New text safe to send (append-only; stop strings never appear)."""
    stopped: bool = False
    """A stop string matched: the request is finished with finish_reason "stop"."""


class TextStream:
    """Detokenizes one request's generated tokens and applies its stop strings.

    With `tokenizer` None (a model folder without one) every token is accepted and the text is
    always empty; stop strings need a tokenizer (the router rejects them without one).
    """

    def __init__(
        self, tokenizer: Tokenizer | None, prompt_token_ids: list[int], stop: tuple[str, ...]
    ) -> None:
        self._detokenizer = (
            IncrementalDetokenizer(tokenizer, prompt_token_ids) if tokenizer else None
        )
        self._matcher = StopStringMatcher(stop)
        self.token_ids: list[int] = []
        """Tokens accepted so far (a migrated request resumes after them)."""

    @property
    def num_tokens(self) -> int:
        """Tokens accepted so far (the completion length)."""
        return len(self.token_ids)

    def add(self, token_ids: list[int]) -> TextDelta:
        """Feeds new tokens; stops at the token that completes a stop string."""
        delta = TextDelta([], "")
        for token_id in token_ids:
            delta.token_ids.append(token_id)
            self.token_ids.append(token_id)
            if self._detokenizer is None:
                continue
            text, stopped = self._matcher.add(self._detokenizer.add_tokens([token_id]))
            delta.text += text
            if stopped:
                delta.stopped = True
                break
        return delta

    def finish(self) -> tuple[str, bool]:
        """(held-back text, stopped), released because the request ended another way.

        A held-back tail may still complete a stop string once the detokenizer flushes it (an
        incomplete UTF-8 character cut off by max_tokens), so it goes through the matcher too.
        """
        if self._detokenizer is None:
            return "", False
        text, stopped = self._matcher.add(self._detokenizer.flush())
        return text + self._matcher.flush(), stopped
