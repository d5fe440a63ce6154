"""The tokenizer the router and the engine share, without torch.

transformers' `AutoTokenizer` imports torch (through its model configuration code), and a router
or client that loads torch pays seconds and hundreds of MB for nothing. So both load the model
folder's `tokenizer.json` with Hugging Face `tokenizers` (the Rust tokenizer that transformers'
fast tokenizers wrap, so ids and text are the same) and render chat templates with
transformers' own Jinja renderer (`transformers.utils.chat_template_utils`, which imports no
torch). Special tokens and the chat template come from `tokenizer_config.json` and
`chat_template.jinja`, as transformers saves them.

Calls are serialized by one lock: a `tokenizers.Tokenizer` must not be called from many threads
at once ("Already borrowed"), and the router serves every request on its own thread. Calls are
short (one prompt, or a few ids for the detokenizer), so contention is small.
"""

from __future__ import annotations

import functools
import json
import threading
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _RustTokenizer

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """A model folder's tokenizer: encode, decode, chat template, special tokens. Thread-safe."""

    def __init__(
        self, tokenizer: _RustTokenizer, settings: dict[str, Any], chat_template: str | None
    ) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self.chat_template = chat_template
        self.special_tokens = {
            name: _token_text(settings.get(name)) for name in _SPECIAL_TOKENS if settings.get(name)
        }
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id: int | None = tokenizer.token_to_id(eos) if eos else None

    @classmethod
    def load(cls, folder: str | Path) -> Tokenizer | None:
        """The tokenizer of a Hugging Face model folder; None if it has no `tokenizer.json`
        (random-weight test models: then only token-id prompts work)."""
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            return None
        settings_file = folder / "tokenizer_config.json"
        settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
        template_file = folder / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else None
        template = template or settings.get("chat_template")
        return cls(_RustTokenizer.from_file(str(folder / "tokenizer.json")), settings, template)

    def prepare_chat_template(self) -> None:
        """Import the renderer and compile the template now (a server calls it at start, so
        the first chat request does not pay the import of transformers, ~0.6 s)."""
        if self.chat_template:
            self.apply_chat_template([{"role": "user", "content": "warm-up"}])

    @functools.cached_property
    def max_bytes_per_token(self) -> int | None:
        """Most UTF-8 bytes any one token stands for (~0.1 s to compute, once), so a text of
        `len(text)` characters has at least `len(text) / max_bytes_per_token` tokens: a prompt
        far too long is refused without tokenizing it. None when the tokenizer normalizes text
        first (a normalizer may delete characters, so no such bound holds)."""
        if self._tokenizer.normalizer is not None:
            return None
        with self._lock:
            return (
                max(
                    len(self._tokenizer.decode([i], skip_special_tokens=False).encode())
                    for i in range(self.vocab_size)
                )
                or None
            )

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    @property
    def vocab_size(self) -> int:
        """Ids in the vocabulary, added tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text` (by default without special tokens: a chat template adds its own)."""
        with self._lock:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(
        self,
        token_ids: list[int],
        skip_special_tokens: bool = True,
        clean_up_tokenization_spaces: bool = False,
    ) -> str:
        """Text of `token_ids`. Spaces are never cleaned up (that rewrite is not prefix-stable,
        so streamed text could not match it); the argument exists for callers written against
        transformers' tokenizers and must be False."""
        if clean_up_tokenization_spaces:
            raise ValueError("clean_up_tokenization_spaces: not supported (not prefix-stable)")
        with self._lock:
            return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
    ) -> Any:
        """The prompt text of `messages` (token ids with `tokenize=True`), ending with the
        assistant's turn opener when `add_generation_prompt`. Raises ValueError without a
        template, and whatever the template raises for messages it refuses."""
        if not self.chat_template:
            raise ValueError("chat: this model's tokenizer has no chat template")
        from transformers.utils.chat_template_utils import render_jinja_template

        template_vars: dict[str, Any] = dict(self.special_tokens)  # bos_token, eos_token, ...
        rendered = render_jinja_template(
            conversations=[messages],
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            **template_vars,
        )
        text = rendered[0][0] if isinstance(rendered, tuple) else rendered
        text = text[0] if isinstance(text, list) else text
        return self.encode(text) if tokenize else text


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return value["content"] if isinstance(value, dict) else str(value)
