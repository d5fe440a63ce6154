"""What a new request must satisfy before it enters an engine; every failure names the field."""

from __future__ import annotations

import numbers
from collections.abc import Iterable

from services.engine.block_hash import MAX_CACHE_SALT_BYTES
from services.engine.config import EngineConfig, EngineRole
from services.engine.errors import InvalidRequestError, ResourceExhaustedError
from services.engine.sampling_params import SamplingParams
from services.kv_transfer.handle import KVHandle


def check_token_ids(token_ids: list[int], vocab_size: int, field: str) -> None:
    """InvalidRequestError naming `field` if any id is outside [0, vocab_size)."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(field, f"token ids {bad[:5]} outside [0, {vocab_size})")


def check_sampling_ids(params: SamplingParams, vocab_size: int) -> None:
    """InvalidRequestError naming `stop_token_ids` or `logit_bias` when one of their token ids
    is outside [0, vocab_size) (the value ranges are SamplingParams' own checks)."""
    check_token_ids(list(params.stop_token_ids), vocab_size, "stop_token_ids")
    check_token_ids([t for t, _ in params.logit_bias], vocab_size, "logit_bias")


def _integers(values: Iterable | None, field: str, message: str) -> list[int]:
    """`values` as a list of ints; InvalidRequestError(`field`, `message`) for None or unless
    every one is an integer (bools are not)."""
    if values is None or not all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in values
    ):
        raise InvalidRequestError(field, message)
    return [int(t) for t in values]


def check_cache_salt(cache_salt: str | None) -> None:
    """None (no salt) or a non-empty string of at most MAX_CACHE_SALT_BYTES UTF-8 bytes."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str) or not cache_salt:
        raise InvalidRequestError(
            "cache_salt", f"must be a non-empty string or None, got {cache_salt!r:.40}"
        )
    if len(cache_salt.encode()) > MAX_CACHE_SALT_BYTES:
        raise InvalidRequestError(
            "cache_salt", f"at most {MAX_CACHE_SALT_BYTES} bytes, got {len(cache_salt.encode())}"
        )


class RequestChecker:
    """Turns a prompt into token ids and checks a request against the engine's role, config,
    vocabulary and KV cache size.

    Raises InvalidRequestError (bad prompt, ids, stop token or logit_bias ids outside the
    vocabulary, params, salt or KV handle) and
    ResourceExhaustedError (the request could never fit in `num_blocks` KV blocks).
    """

    def __init__(self, config: EngineConfig, vocab_size: int, num_blocks: int, tokenizer) -> None:
        assert config.max_model_len is not None
        self.config = config
        self.max_model_len = config.max_model_len
        self.vocab_size = vocab_size
        self.num_blocks = num_blocks
        self.tokenizer = tokenizer

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text prompt (no special tokens added) or a checked copy of given ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "prompt", "this model folder has no tokenizer; send token ids"
                )
            return self.tokenizer.encode(prompt, add_special_tokens=False) if prompt else []
        return _integers(prompt, "prompt_token_ids", "must be a string or a list of integers")

    def output_ids(self, output_token_ids: list[int] | None, params: SamplingParams) -> list[int]:
        """A checked copy of a migrated request's earlier outputs (empty for None): integers
        in the vocabulary, fewer than max_tokens."""
        if output_token_ids is None:
            return []
        ids = _integers(output_token_ids, "output_token_ids", "must be a list of integers")
        check_token_ids(ids, self.vocab_size, "output_token_ids")
        if isinstance(params, SamplingParams) and len(ids) >= params.max_tokens:
            raise InvalidRequestError(
                "output_token_ids",
                f"{len(ids)} tokens already generated; max_tokens is {params.max_tokens}",
            )
        return ids

    def check(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        kv_handle: KVHandle | None,
        cache_salt: str | None,
        num_resumed: int = 0,
    ) -> None:
        """`num_resumed`: outputs generated before a migration (`output_ids`), whose KV is
        computed (or pulled) with the prompt's."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                "sampling_params", f"expected SamplingParams, got {type(params).__name__}"
            )
        check_cache_salt(cache_salt)
        if not prompt_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        if len(prompt_ids) + num_resumed >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"{len(prompt_ids)} tokens"
                + (f" + {num_resumed} already generated" if num_resumed else "")
                + f"; max_model_len is {self.max_model_len}",
            )
        check_token_ids(prompt_ids, self.vocab_size, "prompt_token_ids")
        check_sampling_ids(params, self.vocab_size)
        role = self.config.role
        if role != EngineRole.DECODE and kv_handle is not None:
            raise InvalidRequestError(
                "kv_handle", f"a {role.name} engine computes its own prompt KV"
            )
        if kv_handle is not None:
            self._check_handle(kv_handle, request_id, len(prompt_ids) + num_resumed)
        # A PREFILL engine only ever holds the prompt (+ the first token) before the hand-off.
        max_tokens = num_resumed + 1 if role == EngineRole.PREFILL else params.max_tokens
        max_len = min(len(prompt_ids) + max_tokens, self.max_model_len)
        needed = -(-max_len // self.config.block_size)
        if needed > self.num_blocks:
            raise ResourceExhaustedError(
                f"request needs {needed} KV blocks, the cache has {self.num_blocks}"
            )

    def _check_handle(self, handle: KVHandle, request_id: str, num_prompt_tokens: int) -> None:
        """A handle must describe exactly this request's prompt (+ outputs generated before a
        migration) in this engine's block size."""
        if handle.request_id != request_id:
            raise InvalidRequestError(
                "kv_handle", f"is for request {handle.request_id!r}, not {request_id!r}"
            )
        if handle.num_tokens != num_prompt_tokens:
            raise InvalidRequestError("kv_handle", "num_tokens does not match the prompt length")
        block_size = self.config.block_size
        if len(handle.block_ids) != -(-num_prompt_tokens // block_size):
            raise InvalidRequestError(
                "kv_handle",
                f"{len(handle.block_ids)} blocks cannot hold {num_prompt_tokens} tokens "
                f"at block_size {block_size}",
            )
        check_token_ids([handle.first_token_id], self.vocab_size, "kv_handle.first_token_id")
