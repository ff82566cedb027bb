"""The model runner: construction, public entry points and the forward path.

Its phases are components built here and handed their dependencies: input preparation
(`InputPreparer` -> `PreparedInputs`), static buffers and CUDA graphs (`CudaGraphs`, which
also owns dummy padding rows), and warm-up (`warmup`). Eager on CPU or with graphs disabled.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from tqdm import tqdm

from common.model.attention import AttentionMetadata
from common.model.llama import LlamaModel
from target_service.runner.graphs import CudaGraphs, StaticBuffers
from target_service.runner.inputs import InputPreparer, PreparedInputs
from target_service.scheduler import Row

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerConfig:
    max_batch_size: int
    max_draft_len: int
    max_context_len: int
    block_size: int
    dummy_block: int
    cuda_graphs: bool = True

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_context_len // self.block_size)

    def batch_buckets(self) -> list[int]:
        sizes = [b for b in (1, 2, 4, 8, 16, 24, 32, 48, 64) if b < self.max_batch_size]
        return sizes + [self.max_batch_size]

    def graph_shapes(self) -> list[tuple[int, int]]:
        qs = sorted({1, 1 + self.max_draft_len})
        return [(bs, q) for q in qs for bs in self.batch_buckets()]


@dataclass
class StepLogits:
    logits: torch.Tensor  # [N, V] fp32 on the model's device
    spans: list[tuple[int, int]]  # per decode row: (offset into logits, 1 + padded drafts)
    graph: tuple[int, int] | None  # the (bucket, q) replayed, or None when eager


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_caches: torch.Tensor, config: RunnerConfig):
        self.model = model
        self.kv_caches = kv_caches
        self.config = config
        self.device = kv_caches.device
        self.inputs = InputPreparer(
            config.block_size, config.max_blocks_per_seq, config.dummy_block, self.device
        )
        self.graphs: CudaGraphs | None = None
        if config.cuda_graphs and self.device.type == "cuda":
            buffers = StaticBuffers.allocate(
                config.max_batch_size,
                1 + config.max_draft_len,
                config.max_blocks_per_seq,
                model.cfg.vocab_size,
                self.device,
            )
            self.graphs = CudaGraphs(
                self._forward_logits, buffers, config.block_size, config.dummy_block
            )

    def _forward_logits(self, ids, positions, meta: AttentionMetadata, index=None):
        hidden = self.model(ids, positions, self.kv_caches, meta)
        if index is not None:
            hidden = hidden.index_select(0, index)
        return self.model.compute_logits(hidden)

    def warmup(self, progress: bool = True) -> None:
        """One eager step to load kernels, then (GPU) capture every graph shape."""
        cfg = self.config
        with torch.inference_mode():
            q = 1 + cfg.max_draft_len
            ids = torch.zeros(q, dtype=torch.long, device=self.device)
            pos = torch.arange(q, device=self.device)
            base = cfg.dummy_block * cfg.block_size
            meta = AttentionMetadata(
                slot_mapping=base + pos % cfg.block_size,
                block_tables=torch.full(
                    (1, cfg.max_blocks_per_seq),
                    cfg.dummy_block,
                    dtype=torch.int32,
                    device=self.device,
                ),
                context_lens=torch.tensor([q], dtype=torch.int32, device=self.device),
                uniform_q=q,
            )
            self._forward_logits(ids, pos, meta)
            if self.graphs is not None:
                shapes = cfg.graph_shapes()
                with tqdm(
                    total=len(shapes),
                    desc="capturing CUDA graphs",
                    disable=not progress,
                    leave=False,
                ) as bar:
                    self.graphs.capture(shapes, progress=bar)
                log.info("captured %d CUDA graphs: %s", len(shapes), shapes)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def prepare(self, rows: list[Row], tables: list[list[int]]) -> PreparedInputs:
        return self.inputs.prepare(rows, tables)

    @torch.inference_mode()
    def forward(
        self, rows: list[Row], tables: list[list[int]], allow_graphs: bool = True
    ) -> StepLogits:
        """Run the model on the scheduled rows; logits for every decode row's verify span.

        `allow_graphs=False` forces the eager path (tests compare the two)."""
        inputs = self.prepare(rows, tables)
        use = allow_graphs and self.graphs is not None
        key = self.graphs.select(inputs) if use else None
        if key is not None:
            logits = self.graphs.replay(key, inputs)
        else:
            logits = self._forward_logits(
                inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_index
            )
        return StepLogits(logits=logits, spans=inputs.logit_spans, graph=key)
