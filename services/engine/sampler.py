"""Token sampling: logit bias and penalties, then greedy or temperature, top-k, top-p, with
per-request seeds.

The order is vLLM v1's (vllm/v1/sample/sampler.py): logit bias, then the repetition, frequency
and presence penalties (`penalties.py`), for greedy rows too; then temperature, top-k and top-p.
Log-probabilities stay those of the model's raw logits (vLLM's default `raw_logprobs` mode).
A row's token depends only on its own logits, params and token history; rows without a bias or
penalty skip that stage entirely (plain greedy rows are one batched argmax).

Each sampled (non-greedy) request draws from its own generator seeded by (request seed, output
index), so its tokens depend neither on its batch neighbours nor on which worker (prefill or
decode) sampled which token, nor on preemption and recomputation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.engine.outputs import TokenLogprobs
from services.engine.penalties import apply_penalties
from services.engine.sampling_params import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, step) over 63 bits


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs to know about one row of logits.

    The token histories are the request's own lists (references, not copies): read during this
    step only, before the sampled token is appended.
    """

    params: SamplingParams
    seed: int
    output_index: int  # index of the token being sampled among the request's outputs
    prompt_token_ids: Sequence[int] = ()  # for the repetition penalty
    output_token_ids: Sequence[int] = ()  # the outputs so far: len == output_index


def sample(
    logits: torch.Tensor, rows: list[SamplingRow]
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: float32 [num_rows, vocab_size] -> (one token id per row, its log-probabilities
    under the raw logits for rows whose params ask for them, else None)."""
    assert logits.shape[0] == len(rows)
    tokens = logits.argmax(dim=-1).tolist()  # greedy for every plain row; the others overwrite
    for i, row in enumerate(rows):
        params = row.params
        if not params.adjusts_logits and params.greedy:
            continue
        row_logits = logits[i]  # [vocab_size]
        if params.adjusts_logits:
            row_logits = apply_penalties(
                row_logits, params, row.prompt_token_ids, row.output_token_ids
            )
        tokens[i] = int(row_logits.argmax()) if params.greedy else _sample_row(row_logits, row)
    return tokens, _logprobs(logits, rows, tokens)


def _logprobs(
    logits: torch.Tensor, rows: list[SamplingRow], tokens: list[int]
) -> list[TokenLogprobs | None]:
    out: list[TokenLogprobs | None] = [None] * len(rows)
    num_top = {i: n for i, row in enumerate(rows) if (n := row.params.logprobs) is not None}
    wanted = list(num_top)
    if not wanted:
        return out
    logprobs = torch.log_softmax(logits[wanted], dim=-1)  # [len(wanted), vocab_size]
    top_values, top_ids = logprobs.topk(max(num_top.values()), dim=-1)
    chosen = logprobs[torch.arange(len(wanted)), torch.tensor([tokens[i] for i in wanted])]
    ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
    for j, i in enumerate(wanted):
        n = num_top[i]
        top = tuple(zip(top_ids[j, :n].tolist(), top_values[j, :n].tolist(), strict=True))
        out[i] = TokenLogprobs(tokens[i], float(chosen[j]), int(ranks[j]), top)
    return out


def _sample_row(logits: torch.Tensor, row: SamplingRow) -> int:
    """logits: [vocab_size]. Top-k, then top-p (nucleus; Holtzman et al. 2020) on the tempered
    softmax."""
    params = row.params
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[0]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, sorted_ids = probs.sort(descending=True)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop = (sorted_probs.cumsum(0) - sorted_probs) >= params.top_p
        probs = probs.scatter(0, sorted_ids[drop], 0.0)
    generator = torch.Generator(device=logits.device)
    generator.manual_seed((row.seed * _SEED_MIX + row.output_index) % (1 << 63))
    return int(torch.multinomial(probs, 1, generator=generator).item())
