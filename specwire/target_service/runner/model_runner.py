"""The model runner: construction, public entry points and the forward path.

Its phases are components built here and handed their dependencies: input preparation
(`InputPreparer`: rows -> a varlen step or, for the SDPA backend, `PreparedInputs`), CUDA graphs
(`TokenGraphs`, which also owns the static and pinned buffers), and warm-up (`warmup`).

Two paths, chosen by the model's attention backend:
- varlen (the Triton backend, on the GPU): rows of any lengths in one launch per layer; every
  step replays the graph of its padded token count; eager only when graphs are off or a step
  is larger than the largest bucket.
- SDPA (the CPU backend and reference): uniform steps (every row 1 + K tokens) or ragged ones,
  eager. Drafts are padded to one length per step so that a batch stays uniform.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from tqdm import tqdm

from specwire.common.model.attention import AttentionMetadata
from specwire.common.model.llama import LlamaModel
from specwire.common.model.paged import blocks_for
from specwire.target_service.runner.device_drafts import DeviceDrafts
from specwire.target_service.runner.graphs import TokenGraphs
from specwire.target_service.runner.inputs import InputPreparer, PreparedInputs
from specwire.target_service.runner.pipeline import accepted_counts
from specwire.target_service.scheduler import Row

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerConfig:
    max_batch_size: int
    max_draft_len: int
    max_context_len: int
    block_size: int
    dummy_block: int
    cuda_graphs: bool = True
    max_num_tokens: int = 1024
    # Pipelined drafting steps (`--pipeline-drafts`): every step counts its rows' accepted
    # drafts on the device, and a row may be shifted by the step before's (runner/pipeline.py).
    pipelined: bool = False

    @property
    def max_blocks_per_seq(self) -> int:
        return blocks_for(self.max_context_len, self.block_size)

    @property
    def max_logit_rows(self) -> int:
        return self.max_batch_size * (1 + self.max_draft_len)


@dataclass
class StepLogits:
    logits: torch.Tensor  # [N, V] fp32 on the model's device (N may exceed the rows used)
    spans: list[tuple[int, int]]  # per decode row: (offset into logits, 1 + drafts)
    graph: object | None  # the graph replayed (its key), or None when eager
    # The argmax of every logit row when the graph computed it: pinned host memory, valid
    # once `ModelRunner.wait` returned (one copy back per step, no separate argmax launch).
    greedy: torch.Tensor | None = None
    # Eager steps: the argmax of every logit row, on the model's device (one of the two is set).
    argmax: torch.Tensor | None = None
    done: object | None = None  # CUDA event after which the step's results are valid
    # A sample of graph steps (graphs.TIMING_EVERY): a timed event recorded just before the replay
    began: object | None = None
    # Drafting on the device (`device_drafts`): ([B, kmax] drafts, [B] found) in the step's row
    # order, readable once `ModelRunner.wait` returned; None when no row drafted there.
    drafted: tuple[torch.Tensor, torch.Tensor] | None = None

    def device_drafts(self, rows: list[Row]) -> None:
        """After `ModelRunner.wait`: each row that drafted on the device gets its real drafts
        (none where the lookup found no match) in place of its placeholders."""
        if self.drafted is None:
            return
        drafts, found = (t.tolist() for t in self.drafted)
        for i, row in enumerate(rows):
            if row.on_device:
                row.drafts = drafts[i][: len(row.drafts)] if found[i] else []
                row.on_device = False

    def gpu_seconds(self) -> float | None:
        """Sampled graph steps, after `ModelRunner.wait`: the device time of the step, from the
        moment the stream reached it to its end (the host's lateness in launching it
        excluded); None for the others."""
        if self.began is None or self.done is None:
            return None
        return self.began.elapsed_time(self.done) / 1e3

    def tokens(self) -> list[int]:
        """The argmax of every logit row, on the host (after `ModelRunner.wait`)."""
        return (self.greedy if self.greedy is not None else self.argmax).tolist()


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_caches: torch.Tensor,
        config: RunnerConfig,
        device_drafts: DeviceDrafts | None = None,
    ):
        self.model = model
        self.device_drafts = device_drafts
        self.kv_caches = kv_caches
        self.config = config
        self.device = kv_caches.device
        self.inputs = InputPreparer(
            config.block_size, config.max_blocks_per_seq, config.dummy_block, self.device
        )
        self.varlen = bool(model.attention.varlen)
        # The argmax of the last step's logit rows, on the device: where the next step's
        # `feed` finds tokens computed by a step whose results the host has not read yet.
        self.last_argmax: torch.Tensor | None = None
        # Pipelined: the last step's accepted drafts per row, on the device (`pipeline.py`).
        self.last_acc: torch.Tensor | None = None
        self._kidx = torch.arange(max(1, config.max_draft_len), device=self.device)
        self.graphs: TokenGraphs | None = None
        if config.cuda_graphs and self.device.type == "cuda" and model.attention.graphs:
            self.graphs = TokenGraphs(
                self._forward_logits,
                max_tokens=config.max_num_tokens,
                max_rows=config.max_batch_size,
                max_blocks=config.max_blocks_per_seq,
                max_logit_rows=config.max_logit_rows,
                vocab_size=model.cfg.vocab_size,
                device=self.device,
                device_drafts=device_drafts,
                block_size=config.block_size,
                pipelined=config.pipelined,
                max_draft_len=config.max_draft_len,
            )

    @property
    def pads_drafts(self) -> bool:
        """Whether the executor must pad every decode row's drafts to one length (uniform
        batches for the SDPA backend). Varlen backends take each row's real drafts."""
        return not self.varlen

    def synchronize(self) -> None:
        """Wait for the device to finish the work queued so far (no-op on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def ready(self, step: StepLogits) -> bool:
        """Whether a launched step has finished (never blocks; True on the CPU, whose steps
        finish inside `forward`)."""
        return step.done is None or step.done.query()

    def wait(self, step: StepLogits) -> None:
        """Wait for one launched step (a later step may still be running)."""
        if step.done is not None:
            step.done.synchronize()
        else:
            self.synchronize()

    def _forward_logits(self, ids, positions, meta: AttentionMetadata, index=None):
        hidden = self.model(ids, positions, self.kv_caches, meta)
        if index is not None:
            hidden = hidden.index_select(0, index)
        return self.model.compute_logits(hidden)

    def warmup(self, progress: bool = True) -> None:
        """One eager step to load kernels, then (GPU) capture every graph bucket."""
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
                cu_seqlens_q=torch.tensor([0, q], dtype=torch.int32, device=self.device),
            )
            self._forward_logits(ids, pos, meta)
            if self.graphs is not None:
                buckets = self.graphs.buckets
                with tqdm(
                    total=len(buckets),
                    desc="capturing CUDA graphs",
                    disable=not progress,
                    leave=False,
                ) as bar:
                    self.graphs.capture(buckets, progress=bar)
                log.info("captured %d CUDA graphs (tokens): %s", len(buckets), buckets)
            note = getattr(self.model.ops, "gemm_note", None)
            if note is not None and (text := note()):
                log.info("%s", text)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def prepare(
        self, rows: list[Row], tables: list[list[int]], shifts: list[int] | None = None
    ) -> PreparedInputs:
        return self.inputs.prepare(rows, tables, shifts)

    @torch.inference_mode()
    def forward(
        self, rows: list[Row], tables: list[list[int]], allow_graphs: bool = True
    ) -> StepLogits:
        """Launch the model on the scheduled rows: logits for every decode row's verify span.
        Nothing waits for the device: `wait(result)` before reading it.

        `allow_graphs=False` forces the eager path (tests compare the two)."""
        pipelined = self.config.pipelined
        if self.varlen:
            step = self._varlen(rows, tables, None)
            key = self.graphs.select(step) if allow_graphs and self.graphs else None
            if key is not None:  # (the graph shifts the rows on the device)
                logits, greedy, done, began, drafted = self.graphs.replay(key, step)
                self.last_argmax = self.graphs.argmax
                if pipelined:
                    self.last_acc = self.graphs.acc
                return StepLogits(
                    logits, step.spans, key, greedy, done=done, began=began, drafted=drafted
                )
            shifts = self._host_shifts(rows)
            if shifts is not None:
                step = self._varlen(rows, tables, shifts)
            ids, pos, meta, index = self.inputs.varlen_tensors(step)
            self._feed(ids, step.feed)
            drafted = self._draft_eager(ids, meta, step.drafting)
            result = self._eager_result(self._forward_logits(ids, pos, meta, index), step.spans)
            result.drafted = drafted
            if pipelined:
                self._accept_eager(rows, ids, result.argmax, step.verify, drafted)
            return result
        shifts = self._host_shifts(rows)
        inputs = self.prepare(rows, tables, shifts)
        self._feed(inputs.input_ids, inputs.feed)
        drafted = None
        starts = [0]
        for row in rows:
            fed = row.num_committed + (len(row.drafts) + row.pad if row.decode else 0)
            starts.append(starts[-1] + fed)
        if self.device_drafts is not None:  # (the ids are stored even where no row drafts)
            drafting = self._drafting(rows, starts, shifts)
            drafted = self._draft_eager(inputs.input_ids, inputs.meta, drafting)
        logits = self._forward_logits(
            inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_index
        )
        result = self._eager_result(logits, inputs.logit_spans)
        result.drafted = drafted
        if pipelined:
            verify = self._verify_inputs(rows, starts, inputs.logit_spans)
            self._accept_eager(rows, inputs.input_ids, result.argmax, verify, drafted)
        return result

    def _varlen(self, rows: list[Row], tables: list[list[int]], shifts: list[int] | None):
        step = self.inputs.prepare_varlen(rows, tables, shifts)
        if self.device_drafts is not None and any(row.on_device for row in rows):
            step.drafting = self._drafting(rows, step.cu_seqlens, shifts)  # else no row drafts
        if self.config.pipelined:
            step.after = after = [row.after for row in rows]
            step.shifted = any(a >= 0 for a in after)
            if any(row.drafts for row in rows):  # else every row accepts none (`verify` None)
                step.verify = self._verify_inputs(rows, step.cu_seqlens, step.spans)
        return step

    @staticmethod
    def _drafting(
        rows: list[Row], starts: list[int], shifts: list[int] | None = None
    ) -> tuple[list[int], list[int], list[int]]:
        """Per row (committed tokens in the cache once this step's are stored, drafts to make
        on the device — 0 for a row that does not —, flat index of its first draft)."""
        lengths, caps, offsets = [], [], []
        for r, (row, start) in enumerate(zip(rows, starts, strict=False)):
            shift = shifts[r] if shifts else 0
            lengths.append(row.request.num_computed + row.num_committed + shift)
            caps.append(len(row.drafts) if row.on_device else 0)
            offsets.append(start + row.num_committed)
        return lengths, caps, offsets

    @staticmethod
    def _verify_inputs(rows: list[Row], starts: list[int], spans: list[tuple[int, int]]):
        """Per row (flat index of its first draft, its first logit row, its real drafts),
        for counting its accepted drafts on the device (`pipeline.accepted_counts`)."""
        first_draft, first_logit, drafts = [], [], []
        spans_left = iter(spans)
        for row, start in zip(rows, starts, strict=False):
            if row.decode:
                first_draft.append(start + row.num_committed)
                first_logit.append(next(spans_left)[0])
                drafts.append(len(row.drafts))
            else:
                first_draft.append(0)
                first_logit.append(0)
                drafts.append(0)
        return first_draft, first_logit, drafts

    def _host_shifts(self, rows: list[Row]) -> list[int] | None:
        """Pipelined eager steps: each row's shift, read from the step before's accepted
        counts (a graph step shifts its rows on the device instead); None when no row has
        one."""
        if not self.config.pipelined or all(row.after < 0 for row in rows):
            return None
        if self.last_acc is None:
            raise RuntimeError("a step is shifted by a previous step that never ran")
        acc = self.last_acc.tolist()
        return [acc[row.after] if row.after >= 0 else 0 for row in rows]

    def _accept_eager(self, rows, ids, argmax, verify, drafted) -> None:
        """An eager step's accepted counts (`last_acc`; and in the graphs' buffer, where the
        next step may be a graph's). A row drafted on the device without a match has none;
        `verify` None: no row has drafts, so none accepts any."""
        dev = ids.device
        if verify is None:
            acc = torch.zeros(len(rows), dtype=torch.long, device=dev)
        else:
            first_draft, first_logit, drafts = verify
            if drafted is not None:
                found = drafted[1].tolist()
                drafts = [
                    0 if row.on_device and not found[r] else k
                    for r, (row, k) in enumerate(zip(rows, drafts, strict=True))
                ]
            as_tensor = lambda v: torch.tensor(v, dtype=torch.long, device=dev)  # noqa: E731
            acc = accepted_counts(
                ids, argmax, as_tensor(first_draft), as_tensor(first_logit), as_tensor(drafts),
                self._kidx,
            )  # fmt: skip
        self.last_acc = acc
        if self.graphs is not None:
            self.graphs.acc[: len(acc)].copy_(acc)

    def _draft_eager(self, ids: torch.Tensor, meta: AttentionMetadata, drafting):
        """Store the step's ids in the token cache and draft the rows that draft on the device
        (eager steps); (drafts, found) or None."""
        dd = self.device_drafts
        if dd is None:
            return None
        dd.store(ids, meta.slot_mapping)
        if drafting is None or not any(drafting[1]):
            return None
        lengths, caps, offsets = drafting
        rows, dev = len(caps), ids.device
        drafts = torch.zeros(rows, dd.kmax, dtype=torch.long, device=dev)
        found = torch.zeros(rows, dtype=torch.bool, device=dev)
        as_tensor = lambda v: torch.tensor(v, dtype=torch.long, device=dev)  # noqa: E731
        dd.draft(
            ids, meta.slot_mapping, meta.block_tables, as_tensor(lengths), as_tensor(caps),
            as_tensor(offsets), drafts, found,
        )  # fmt: skip
        return drafts, found

    def _feed(self, ids: torch.Tensor, feed: list[tuple[int, int]]) -> None:
        """Fill the placeholders of tokens the previous step computed from its argmax."""
        if not feed:
            return
        if self.last_argmax is None:
            raise RuntimeError("a step feeds tokens of a previous step that never ran")
        dst, src = zip(*feed, strict=True)
        ids[torch.tensor(dst, device=ids.device)] = self.last_argmax[
            torch.tensor(src, device=ids.device)
        ]

    def _eager_result(self, logits: torch.Tensor, spans) -> StepLogits:
        argmax = logits.argmax(dim=-1)
        if self.graphs is not None:  # a graph step after this one gathers from its buffer
            self.graphs.argmax[: len(argmax)].copy_(argmax)
        self.last_argmax = argmax
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return StepLogits(logits, spans, None, argmax=argmax, done=done)
