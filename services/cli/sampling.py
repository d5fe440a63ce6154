"""The prompt and sampling flags of `pdserve run` and `pdserve generate`, and the parsing of
their values (the service commands' flags are generated from configs: `services/flags.py`).

Imports no torch: `pdserve generate` and `pdserve --help` stay light.
"""

from __future__ import annotations

import argparse

from services.engine.sampling_params import SamplingParams


def add_prompt_source(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="raw prompt text")
    source.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    source.add_argument("--chat", help="one user message, formatted with the model's chat template")


def add_sampling(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-tokens", type=int, default=64, help="most tokens to generate (default: 64)"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: smallest token set with this probability mass (default: 1.0)",
    )
    parser.add_argument("--top-k", type=int, default=-1, help="-1 disables (default: -1)")
    parser.add_argument("--seed", type=int, default=None, help="the request's sampling seed")
    parser.add_argument("--ignore-eos", action="store_true", help="generate past end-of-sequence")
    parser.add_argument(
        "--logprobs",
        type=int,
        default=None,
        help="with --json: each token's log-probability and this many top alternatives (0..20)",
    )
    # Penalties and logit bias: vLLM's definitions (services/engine/sampling_params.py).
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0; 1 is off")
    parser.add_argument("--logit-bias", default="", metavar="ID:BIAS,...", help="add to logits")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags of `run` and `generate`; ValueError naming a bad field."""
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        logit_bias=tuple(parse_logit_bias(args.logit_bias)),
    )


def parse_ids(text: str) -> list[int]:
    """`--prompt-ids 1,2,3` -> [1, 2, 3]; ValueError naming the flag."""
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"prompt-ids: expected comma-separated integers, got {text!r}") from None


def parse_logit_bias(text: str) -> list[tuple[int, float]]:
    """`--logit-bias 5:-100,7:2.5` -> [(5, -100.0), (7, 2.5)]; ValueError naming the flag."""
    try:
        return [(int(t), float(b)) for t, b in (p.split(":") for p in text.split(",") if p.strip())]
    except ValueError:
        raise ValueError(f"logit-bias: expected ID:BIAS,..., got {text!r}") from None
