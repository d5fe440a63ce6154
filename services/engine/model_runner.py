"""Model runner: loads the model and turns a `SchedulerOutput` into sampled tokens.

Builds the flattened step inputs (input_ids, positions, slot_mapping, block tables), runs the
paged forward, and samples one token per request that reached the end of its tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from services.engine.attention import AttentionMetadata, PrefillSeq
from services.engine.kv_cache import KVCache, slot_mapping
from services.engine.sampler import TokenLogprobs, sample
from services.engine.scheduler import ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from services.engine.cuda_graphs import DecodeGraphs
    from services.engine.models import PagedLlamaForCausalLM

logger = logging.getLogger(__name__)


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # request_id -> token id
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # for requests that asked
    num_tokens_by_request: dict[str, int] = field(default_factory=dict)  # what the forward saw


class ModelRunner:
    """Executes one scheduled step on the model; stateless apart from the model itself."""

    def __init__(
        self,
        model: PagedLlamaForCausalLM,
        kv_cache: KVCache,
        device: str,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        """`graphs`: CUDA graphs that run decode-only steps up to their largest size."""
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.graphs = graphs
        self.vocab_size: int = model.config.vocab_size

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if not out.scheduled:
            return ModelRunnerOutput()
        # Prefill chunks first, longest first (equal lengths side by side), then single-token
        # requests as one decode batch.
        items = sorted(out.scheduled, key=lambda s: (len(s.token_ids) == 1, -len(s.token_ids)))
        sampling = [(i, s, s.sample) for i, s in enumerate(items) if s.sample is not None]
        if self._graphed(items):
            assert self.graphs is not None
            rows = self.graphs.run(
                [s.token_ids[0] for s in items],
                [s.start_position for s in items],
                [s.block_table for s in items],
            )
            index = torch.tensor([i for i, _, _ in sampling], dtype=torch.long, device=rows.device)
            logits = rows.index_select(0, index)
        else:
            input_ids, positions, meta, logits_rows = self._prepare(items)
            logits_indices = torch.tensor(
                [logits_rows[i] for i, _, _ in sampling], dtype=torch.long
            )
            logits = self.model(
                input_ids, positions, self.kv_cache, meta, logits_indices.to(self.device)
            )
        tokens, logprobs = sample(logits, [row for _, _, row in sampling])
        return ModelRunnerOutput(
            sampled={s.request_id: tok for (_, s, _), tok in zip(sampling, tokens, strict=True)},
            logprobs={
                s.request_id: lp
                for (_, s, _), lp in zip(sampling, logprobs, strict=True)
                if lp is not None
            },
            num_tokens_by_request={s.request_id: len(s.token_ids) for s in items},
        )

    def _graphed(self, items: list[ScheduledRequest]) -> bool:
        """A decode-only step that a captured graph holds."""
        return (
            self.graphs is not None
            and all(len(s.token_ids) == 1 for s in items)
            and self.graphs.padded_size(len(items)) is not None
        )

    def _prepare(self, items: list[ScheduledRequest]):
        block_size = self.kv_cache.spec.block_size
        ids: list[int] = []
        pos: list[int] = []
        prefills: list[PrefillSeq] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        logits_rows: list[int] = []
        for item in items:
            n = len(item.token_ids)
            start = len(ids)
            ids.extend(item.token_ids)
            pos.extend(range(item.start_position, item.start_position + n))
            context_len = item.start_position + n
            num_blocks = -(-context_len // block_size)
            if n > 1:
                table = torch.tensor(
                    item.block_table[:num_blocks], dtype=torch.long, device=self.device
                )
                prefills.append(PrefillSeq(start, n, context_len, table))
            else:
                decode_tables.append(item.block_table[:num_blocks])
                decode_lens.append(context_len)
            logits_rows.append(start + n - 1)
        positions = torch.tensor(pos, dtype=torch.long)
        meta = AttentionMetadata(
            slot_mapping=self._slot_mapping(items).to(self.device),
            prefills=tuple(prefills),
            num_prefill_tokens=sum(p.query_len for p in prefills),
            decode_block_tables=_pad(decode_tables).to(self.device),
            decode_context_lens=torch.tensor(decode_lens, dtype=torch.long, device=self.device),
            block_size=block_size,
        )
        return (
            torch.tensor(ids, dtype=torch.long, device=self.device),
            positions.to(self.device),
            meta,
            logits_rows,
        )

    def _slot_mapping(self, items: list[ScheduledRequest]) -> torch.Tensor:
        """[num_tokens] flat cache slot of every token in the step, in batch order."""
        block_size = self.kv_cache.spec.block_size
        return torch.cat(
            [
                slot_mapping(
                    item.block_table,
                    item.start_position,
                    item.start_position + len(item.token_ids),
                    block_size,
                )
                for item in items
            ]
        )


def _pad(tables: list[list[int]]) -> torch.Tensor:
    """Right-pad block tables into [len(tables), max_len]. Padding repeats the row's own first
    block, so a padded position holds finite values of this request (masked by context_len)."""
    width = max((len(t) for t in tables), default=0)
    rows = [t + [t[0]] * (width - len(t)) for t in tables]
    return torch.tensor(rows, dtype=torch.long).reshape(len(tables), width)
