"""`pdserve bench serve`'s flags (`vllm bench serve`'s names where it has them). Light on
purpose: every `pdserve` command builds its parser, so this imports nothing heavy; the run
itself is `command.py`."""

from __future__ import annotations

import argparse

from services import env
from services.bench.dataset import DATASETS


def add_flags(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--base-url", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000"
    )
    target.add_argument("--grpc", metavar="HOST:PORT", help="a pdserve router's gRPC API")
    parser.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="model name to send, and the tokenizer unless --tokenizer (default: %(default)s)",
    )
    parser.add_argument(
        "--tokenizer", default=None, help="model folder or name whose tokenizer cuts the prompts"
    )
    parser.add_argument(
        "--dataset-name",
        choices=DATASETS,
        default="random",
        help="random (fixed or ranged lengths), prefix (a shared prefix), chat (a chat-like "
        "mix), mix (weighted length pairs, --mix)",
    )
    parser.add_argument(
        "--mix",
        default="",
        metavar="W:IN:OUT,...",
        help="mix dataset: weighted (input, output) token pairs, e.g. 0.85:256:64,0.15:2048:64",
    )
    parser.add_argument("--num-prompts", type=int, default=128, help="requests per point")
    parser.add_argument("--random-input-len", type=int, default=256, help="prompt tokens")
    parser.add_argument("--random-output-len", type=int, default=64, help="output tokens")
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths drawn from len*(1-r)..len*(1+r)",
    )
    parser.add_argument(
        "--random-prefix-len", type=int, default=0, help="prefix dataset: shared prefix tokens"
    )
    parser.add_argument(
        "--request-rate",
        default="inf",
        help="req/s, or a comma list for a sweep (inf: all at once)",
    )
    parser.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)"
    )
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument(
        "--goodput", nargs="+", default=[], metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50"
    )
    parser.add_argument(
        "--slo-headers",
        action="store_true",
        help="send the --goodput TTFT, TPOT and ITL objectives with every request as "
        "x-slo-ttft-ms, x-slo-tpot-ms and x-slo-itl-ms headers (llm-d's names; pdserve routes "
        "and schedules by them, others ignore them)",
    )
    parser.add_argument("--bisect", type=int, default=0, help="sweep: points to bisect the knee")
    parser.add_argument(
        "--num-warmups", type=int, default=0, help="requests sent first and discarded"
    )
    parser.add_argument("--seed", type=int, default=0, help="lengths and arrival schedule")
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate every token asked for (default: on)",
    )
    parser.add_argument(
        "--api-key",
        default=env.api_key(),
        help="bearer token (default: $PDSERVE_API_KEY)",
    )
    parser.add_argument("--json", default=None, metavar="OUT", help="write the run as JSON")
    parser.add_argument(
        "--plot", default=None, metavar="OUT.png", help="draw attainment and latency CDFs"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
