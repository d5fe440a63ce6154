"""The prompts of a serving benchmark, cut to exact token counts with the model's tokenizer.

Workloads (`--dataset-name`, nothing downloaded):
- `random`: input and output lengths drawn uniformly from [len * (1 - r), len * (1 + r)] with
  `--random-range-ratio` r (vLLM's `random` dataset; r = 0 gives fixed lengths);
- `prefix`: as `random`, each prompt starting with one shared `--prefix-len`-token prefix
  (vLLM's `--random-prefix-len`), the prefix-cache workload;
- `mix`: fixed (input, output) length pairs drawn with their weights (`--mix
  0.85:256:64,0.15:2048:64`, the suite's W2: mostly chat, some long documents);
- `chat`: a chat-like mix: input and output lengths log-normal with the medians and spreads of
  `CHAT_MIX` (ShareGPT-like: medians 256 and 128 tokens, long right tails), capped.

Text comes from the Python standard library's own source, so any machine has it. Every prompt
starts with a tag unique to the run and the request, so no prompt (past the shared prefix) is
in any server's prefix cache; its length is checked by re-encoding it, since a decoded token
window does not always encode back to the same number of tokens.
"""

from __future__ import annotations

import math
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass

DATASETS = ("random", "prefix", "chat", "mix")
# (median, sigma of the log, cap) for input and output lengths of the chat mix, in tokens.
CHAT_MIX = {"input": (256.0, 0.9, 2048), "output": (128.0, 0.8, 512)}


@dataclass(frozen=True)
class BenchRequest:
    """One request: its prompt text, exactly `prompt_len` tokens, and `output_len` to ask for."""

    prompt: str
    prompt_len: int
    output_len: int


def corpus() -> str:
    """Real English-and-code text for prompts: some standard-library modules' source (imported
    here: the flags import this module, and every `pdserve` command builds them)."""
    import argparse
    import inspect
    import json.decoder
    import logging
    import typing

    return "\n".join(inspect.getsource(m) for m in (argparse, logging, typing, json.decoder))


@dataclass(frozen=True)
class Lengths:
    """What a workload asks for (tokens)."""

    dataset: str = "random"
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.0
    prefix_len: int = 0
    mix: tuple[tuple[float, int, int], ...] = ()  # `mix`: (weight, input_len, output_len)

    def __post_init__(self) -> None:
        if (self.dataset == "mix") != bool(self.mix):
            raise ValueError("--mix: give it with --dataset-name mix, and only then")

    @staticmethod
    def parse_mix(text: str) -> tuple[tuple[float, int, int], ...]:
        """ "0.85:256:64,0.15:2048:64" -> ((0.85, 256, 64), (0.15, 2048, 64)). ValueError naming
        --mix."""
        out = []
        for item in text.split(","):
            try:
                weight, input_len, output_len = item.split(":")
                pair = (float(weight), int(input_len), int(output_len))
            except ValueError:
                raise ValueError(f"--mix: expected WEIGHT:INPUT:OUTPUT, got {item!r}") from None
            if not (pair[0] > 0 and pair[1] > 0 and pair[2] > 0):
                raise ValueError(f"--mix: {item!r}: weight and lengths must be > 0")
            out.append(pair)
        return tuple(out)


def _draws(lengths: Lengths, rng: random.Random) -> tuple[int, int]:
    if lengths.dataset == "mix":
        weights = [w for w, _, _ in lengths.mix]
        _, input_len, output_len = rng.choices(lengths.mix, weights)[0]
        return input_len, output_len
    if lengths.dataset == "chat":
        (im, isig, icap), (om, osig, ocap) = CHAT_MIX["input"], CHAT_MIX["output"]
        return (
            min(icap, max(4, round(rng.lognormvariate(math.log(im), isig)))),
            min(ocap, max(2, round(rng.lognormvariate(math.log(om), osig)))),
        )
    r = lengths.range_ratio

    def draw(n: int) -> int:
        return rng.randint(max(1, math.floor(n * (1 - r))), math.ceil(n * (1 + r)))

    return draw(lengths.input_len), draw(lengths.output_len)


def make_requests(
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    num_prompts: int,
    lengths: Lengths,
    seed: int = 0,
) -> list[BenchRequest]:
    """`num_prompts` requests of `lengths` (seeded lengths and text windows; a fresh run tag
    each call). Raises ValueError when a prompt cannot be cut to its length."""
    if lengths.dataset not in DATASETS:
        raise ValueError(f"--dataset-name: expected one of {DATASETS}, got {lengths.dataset!r}")
    rng = random.Random(seed)
    text_ids = encode(corpus())
    run = uuid.uuid4().hex[:8]
    prefix = decode(text_ids[: lengths.prefix_len]) if lengths.dataset == "prefix" else ""
    prefix_tokens = len(encode(prefix)) if prefix else 0
    requests = []
    for i in range(num_prompts):
        input_len, output_len = _draws(lengths, rng)
        body_len = max(1, input_len - prefix_tokens)
        start = rng.randrange(0, len(text_ids) - body_len - 80)
        window = text_ids[start:]
        prompt = _exact(encode, decode, f"[{run}-{i}] ", window, body_len, prefix, prefix_tokens)
        requests.append(BenchRequest(prompt, body_len + prefix_tokens, output_len))
    return requests


def _exact(
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    tag: str,
    window: list[int],
    num_tokens: int,
    prefix: str,
    prefix_tokens: int,
) -> str:
    """`prefix` (`prefix_tokens` long) + `tag` + text from `window`, encoding to exactly
    `num_tokens` tokens past the prefix."""
    target = num_tokens + prefix_tokens
    if len(encode(tag)) >= num_tokens:  # too short for its tag: text alone
        tag = ""
    got = 0
    for shift in range(16):  # another window start when a token boundary will not settle
        take = max(0, num_tokens - len(encode(tag)))
        for _ in range(6):
            prompt = prefix + tag + decode(window[shift : shift + take])
            got = len(encode(prompt))
            if got == target:
                return prompt
            take = max(0, take + target - got)
    raise ValueError(f"could not cut a prompt to {target} tokens (got {got})")
