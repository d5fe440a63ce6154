"""CUDA graphs of the decode step at a set of batch sizes (vLLM's and SGLang's decode capture).

A decode step of a small model is dozens of small kernels whose launch overhead exceeds their
work; a captured graph replays them all with one launch. Graphs fix shapes and addresses, so
every input lives in a static buffer sized for the largest captured batch, a batch of `n`
requests runs in the graph of the next captured size up, and the rows past `n` are padding: a
slot of -1 (nothing stored, `triton_paged.store_kv_triton`), a context of one token read from
block 0 (finite, whatever it holds) and a discarded output. The block table is as wide as
`max_model_len` needs, so one graph serves every context length. Only backends that launch
without a host sync and take fixed-shape inputs can be captured (`cuda_graph_safe`).

`DecodeGraphs(capture=False)` runs the same padded static batch eagerly: the CPU tests check
padding and the static layout through it, with the Triton kernel in Triton's interpreter.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence

import torch

from services.engine.attention import AttentionBackend, AttentionMetadata, VarlenLayout
from services.engine.config import EngineConfig
from services.engine.kv_cache import KVCache

logger = logging.getLogger(__name__)


def capture_sizes(max_batch_size: int, max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8, up to min(max_batch_size, max_num_seqs) (always included)."""
    top = min(max_batch_size, max_num_seqs)
    sizes = {s for s in (1, 2, 4) if s <= top} | set(range(8, top + 1, 8)) | {top}
    return tuple(sorted(sizes))


class DecodeGraphs:
    """Static decode inputs, and one CUDA graph of `model`'s forward per size in `sizes`.

    Use: `padded_size(n)` (None: no graph that large, run eagerly), then `run(...)`, which
    loads the batch and replays (or, with capture=False, runs eagerly) and returns float32
    logits [n, vocab_size] (a view of a static buffer: read it before the next run).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        sizes: Sequence[int],
        max_model_len: int,
        *,
        capture: bool = True,
    ) -> None:
        self.model, self.kv_cache, self.sizes = model, kv_cache, tuple(sorted(sizes))
        self.block_size = kv_cache.spec.block_size
        device = kv_cache.kv.device
        max_bs = self.sizes[-1]
        max_blocks = -(-max_model_len // self.block_size)
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.long, device=device)
        self.block_table = torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(max_bs, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        if capture:
            self._capture()

    def padded_size(self, num_decodes: int) -> int | None:
        """The smallest captured size holding `num_decodes` requests, or None."""
        index = bisect.bisect_left(self.sizes, num_decodes)
        return self.sizes[index] if index < len(self.sizes) else None

    def metadata(self, size: int) -> AttentionMetadata:
        """The static batch's first `size` rows as attention metadata (views, no copies)."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            prefills=(),
            num_prefill_tokens=0,
            decode_block_tables=self.block_table[:size],
            decode_context_lens=self.seq_lens[:size],
            block_size=self.block_size,
        )
        # Seed the varlen layout with the static buffers (else it would be built per call).
        meta.__dict__["varlen"] = VarlenLayout(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            max_query_len=1,
            max_seq_len=self.block_table.shape[1] * self.block_size,
        )
        return meta

    def load(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        size: int,
    ) -> None:
        """Copy one decode batch into the static buffers, padding rows `len(token_ids)..size`.
        Each request's context is its position + 1 (the new token included)."""
        n = len(token_ids)
        device = self.input_ids.device
        pad = size - n
        self.input_ids[:size].copy_(torch.tensor([*token_ids, *[0] * pad], device=device))
        self.positions[:size].copy_(torch.tensor([*positions, *[0] * pad], device=device))
        slots = [
            table[p // self.block_size] * self.block_size + p % self.block_size
            for table, p in zip(block_tables, positions, strict=True)
        ]
        self.slot_mapping[:size].copy_(torch.tensor([*slots, *[-1] * pad], device=device))
        self.seq_lens[:size].copy_(
            torch.tensor([p + 1 for p in positions] + [1] * pad, dtype=torch.int32, device=device)
        )
        width = self.block_table.shape[1]
        rows = [list(t[:width]) + [0] * (width - min(len(t), width)) for t in block_tables]
        rows += [[0] * width] * pad
        self.block_table[:size].copy_(torch.tensor(rows, dtype=torch.int32, device=device))

    def run(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """Logits [n, vocab_size] of one decode batch of n <= max(sizes) requests."""
        n = len(token_ids)
        size = self.padded_size(n)
        assert size is not None, f"no graph holds {n} requests"
        self.load(token_ids, positions, block_tables, size)
        if size in self.graphs:
            self.graphs[size].replay()
            return self.logits[size][:n]
        return self._forward(size)[:n]

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(
            self.input_ids[:size],
            self.positions[:size],
            self.kv_cache,
            self.metadata(size),
            self.logits_indices[:size],
        )

    def _capture(self) -> None:
        """One graph per size, largest first, sharing one memory pool (as vLLM captures)."""
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self.load([0] * size, [0] * size, [[0]] * size, size)
                self.slot_mapping[:size].fill_(-1)  # warm-up writes nothing to the cache
                for _ in range(2):  # compile the kernels and settle the allocator first
                    self._forward(size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[size] = self._forward(size)
                pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", list(self.sizes))


def decode_graphs(
    config: EngineConfig, model: torch.nn.Module, kv_cache: KVCache
) -> DecodeGraphs | None:
    """The engine's decode graphs: on CUDA, unless `enforce_eager`, for a graph-safe attention
    backend (else None, and why is logged)."""
    if not config.device.startswith("cuda") or config.enforce_eager:
        return None
    attention = getattr(model, "attention")  # noqa: B009 - PagedLlamaForCausalLM's backend
    assert isinstance(attention, AttentionBackend)
    if not attention.cuda_graph_safe:
        logger.info("decode runs eagerly: attention backend %s cannot be captured", attention.name)
        return None
    assert config.max_model_len is not None
    sizes = capture_sizes(config.max_cuda_graph_batch_size, config.max_num_seqs)
    return DecodeGraphs(model, kv_cache, sizes, config.max_model_len)
