"""Logit bias and the repetition, frequency and presence penalties of one row of logits.

Order and definitions are vLLM v1's sampler (vllm/v1/sample/sampler.py,
`Sampler.apply_logits_processors`): the logit bias first (`LogitBiasLogitsProcessor` in
vllm/v1/sample/logits_processor/builtin.py, among the processors that can change the argmax),
then `apply_penalties` (vllm/model_executor/layers/utils.py): the repetition penalty over the
tokens of the prompt or the output, then the frequency and the presence penalty over the output
tokens only (OpenAI's definitions). Temperature, top-k and top-p come after, in the sampler.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.engine.sampling_params import SamplingParams


def apply_penalties(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
) -> torch.Tensor:
    """logits: [vocab_size] -> a new [vocab_size] tensor with `params`' logit bias and penalties
    applied; `logits` itself is left as it is (the raw logits still give the log-probabilities).

    With c[t] the number of times token t occurs in `output_token_ids`:
        logits[t] += logit_bias[t]
        logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r, for t in prompt or output
        logits[t] -= frequency_penalty * c[t]
        logits[t] -= presence_penalty * (c[t] > 0)
    """
    logits = logits.clone()
    device = logits.device
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias, strict=True)
        logits[torch.tensor(ids, device=device)] += torch.tensor(
            biases, dtype=logits.dtype, device=device
        )
    penalty = params.repetition_penalty
    if penalty != 1.0:
        seen = torch.tensor([*prompt_token_ids, *output_token_ids], device=device).unique()
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if output_token_ids and (params.frequency_penalty != 0 or params.presence_penalty != 0):
        ids, counts = torch.tensor(output_token_ids, device=device).unique(return_counts=True)
        # Two subtractions, as vLLM does them (one fused update would round differently).
        logits[ids] -= params.frequency_penalty * counts.to(logits.dtype)
        logits[ids] -= params.presence_penalty
    return logits
