"""The host-only proxy's stand-in for the model (`bench/host_only.py`): `Replay`, recorded
greedy outputs as the model, and `StubForward`, `ModelRunner.forward` minus the device (the
GPU path's host work, tokens from a table or the recording, and with drafting on the device
the lookup, the pipelined shifts and the accepted counts as the graph makes them)."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import torch
from branch_replay import load_outputs
from prompt_pool import Prompt
from sim_device import DeviceClock

from specwire.common.ngram import NGramIndex
from specwire.target_service.params import GenerationParams
from specwire.target_service.runner.model_runner import StepLogits


class Replay:
    """Recorded greedy outputs (`branch_replay.py --save-outputs`) as the stub's model: the
    prompts to send, and each request's true continuation (`truths`, by the client's request
    id), in the stub's vocabulary."""

    def __init__(self, path: str, vocab: int, eos: int | None) -> None:
        records = load_outputs(path)
        counts = Counter(t for r in records for t in r["prompt"] + r["output"])
        ids = [i for i in range(3, vocab) if i != eos]
        to_stub = {tok: ids[i % len(ids)] for i, (tok, _) in enumerate(counts.most_common())}
        self.records = {
            r["id"]: ([to_stub[t] for t in r["prompt"]], [to_stub[t] for t in r["output"]])
            for r in records
        }
        self.pool = [Prompt(r["id"], r["kind"], "") for r in records]
        self.truths: dict[str, list[int]] = {}  # request id -> prompt + recorded output
        self.expected: dict[str, list[int]] = {}  # request id -> the completion it must give

    def params(self, max_new_tokens: int):
        def params_for(name: str, i: int, prompt: Prompt) -> GenerationParams:
            ids, out = self.records[prompt.id]
            rid = f"{name}/{i}"
            n = min(max_new_tokens, len(out))
            self.truths[rid], self.expected[rid] = ids + out, out[:n]
            return GenerationParams(prompt_token_ids=tuple(ids), max_new_tokens=n, request_id=rid)

        return params_for

    def check(self, outputs: dict[str, list[int]]) -> int:
        """Every completion is its recorded continuation (greedy speculation is lossless);
        returns how many were compared."""
        for rid, got in outputs.items():
            if got != self.expected[rid]:
                raise SystemExit(f"replay: request {rid} is not its recorded output")
        return len(outputs)


class StubForward:
    """`ModelRunner.forward` minus the device: the varlen inputs are prepared and staged on
    the host as on the GPU path; the next token at a logit row is `table[id]` (`alt[id]` at
    every 5th position) of the id fed there — or, with `truths` (`Replay`), the recorded
    continuation's token after that position. Tokens the step in flight computes are gathered
    from the previous call's outputs (`feed`), as the graph does on the device.

    With `--draft-on-device` (needs `--replay`) the "device" also drafts: a row's placeholders
    become what `NGramIndex` proposes over its committed tokens, which are the recording's (a
    greedy replay commits exactly those). On a GPU that lookup is device time; here it runs on
    the executor thread, so its time is counted apart (`lookup_s`) and reported. With
    `--pipeline-drafts` the stub moves each row by the step before's accepted drafts and counts
    this step's, as the graph does (`runner/pipeline.py`)."""

    def __init__(
        self,
        runner,
        vocab: int,
        max_tokens: int,
        device: DeviceClock | None,
        span: int = 512,
        truths: dict[str, list[int]] | None = None,
        runner_ngram: tuple[int, int] = (8, 8),  # the engine's --max-ngram, --ngram-vote
    ) -> None:
        self.inputs = runner.inputs
        self.runner = runner
        self.device = device
        self.truths = truths
        self.last_acc = np.zeros(0, np.int64)  # pipelined: the last step's accepted drafts
        self.lookup_s = 0.0  # thread time of the stub's "device" lookups
        self._indexes: dict[str, tuple] = {}  # request id -> (NGramIndex, tokens in it)
        rng = np.random.default_rng(0)
        span = min(span, vocab - 3)
        self.table = rng.integers(3, 3 + span, vocab)
        self.alt = rng.integers(3, 3 + span, vocab)
        self.last = np.zeros(0, np.int64)
        self.max_ngram, self.vote = runner_ngram
        shape = (max_tokens,)
        self.h_ids, self.h_pos, self.h_slots = (np.zeros(shape, np.int64) for _ in range(3))

    def __call__(self, rows, tables, allow_graphs: bool = True) -> StepLogits:
        step = self.runner._varlen(rows, tables, None)  # (+ drafting, shift inputs: the GPU's)
        t, b = step.num_tokens, step.num_rows
        self.h_ids[:t] = step.ids
        self.h_pos[:t] = step.positions
        self.h_slots[:t] = step.slots
        pipelined = step.after is not None
        if pipelined and step.shifted:  # the host staging `TokenGraphs._stage_pipeline` does
            tok_row = np.repeat(np.arange(b), np.diff(step.cu_seqlens))
            after = np.array(step.after, np.int64)
            feed_rows = tok_row[[dst for dst, _ in step.feed]] if step.feed else None
        if pipelined and step.verify is not None:  # (staged as the graph's verification inputs)
            np.array(step.verify, np.int64)
        ids = self.h_ids[:t].copy()  # the "device" part from here on
        pos = self.h_pos[:t].copy()
        shift = np.zeros(b, np.int64)
        if pipelined and step.shifted:
            shift = np.where(after >= 0, self.last_acc[np.maximum(after, 0)], 0)
            pos += shift[tok_row]
        if step.feed:
            dst, src = np.array(step.feed, np.int64).T
            if pipelined and step.shifted:
                src = src + shift[feed_rows]
            ids[dst] = self.last[src]
        drafted = self._draft(rows, step, ids, shift) if step.drafting is not None else None
        at = np.array(step.logit_rows, np.int64)
        fed, lpos = ids[at], pos[at]
        self.last = np.where(lpos % 5 == 4, self.alt[fed], self.table[fed])
        if self.truths is not None:
            self._replay(rows, lpos)
        if pipelined:
            self.last_acc = self._accepted(step, ids, drafted)
        done = None
        if self.device is not None:
            kind = "drafted" if any(row.drafts for row in rows) else "plain"
            done = self.device.launch(t, kind if all(row.decode for row in rows) else None)
        greedy = torch.from_numpy(self.last)
        out = StepLogits(torch.empty(0), step.spans, "stub", greedy=greedy, done=done)
        out.drafted = drafted
        return out

    def _draft(self, rows, step, ids: np.ndarray, shift: np.ndarray):
        """The device's n-gram lookup for the rows that draft there: (drafts, found)."""
        t0 = time.thread_time()
        lengths, caps, offsets = step.drafting
        kmax = max(1, self.runner.config.max_draft_len)
        drafts = np.zeros((len(caps), kmax), np.int64)
        found = np.zeros(len(caps), bool)
        for r, (row, n, cap, off) in enumerate(zip(rows, lengths, caps, offsets, strict=False)):
            if cap <= 0:
                continue
            got = self._lookup(row.request, n + int(shift[r]), cap)
            if got:
                drafts[r, :cap] = got
                found[r] = True
                ids[off : off + cap] = got
        self.lookup_s += time.thread_time() - t0
        return torch.from_numpy(drafts), torch.from_numpy(found)

    def _lookup(self, req, length: int, cap: int) -> list[int]:
        """`NGramIndex.propose(cap)` over the request's first `length` tokens (the
        recording's), one index per request grown as it goes."""
        truth = self.truths[req.client_id]
        index, n = self._indexes.get(req.request_id, (None, 0))
        if index is None or n > length:  # (a preempted request's re-feed starts again)
            index, n = NGramIndex(self.max_ngram, vote=self.vote), 0
        index.extend(truth[n:length])
        self._indexes[req.request_id] = (index, length)
        return index.propose(cap)

    def _accepted(self, step, ids: np.ndarray, drafted) -> np.ndarray:
        """Each row's accepted drafts (`pipeline.accepted_counts`' rule; none where no row
        has drafts: `verify` None)."""
        if step.verify is None:
            return np.zeros(step.num_rows, np.int64)
        first, logit, drafts = step.verify
        caps = step.drafting[1] if step.drafting is not None else None
        found = drafted[1].numpy() if drafted is not None else None
        acc = np.zeros(len(first), np.int64)
        for r, (f, g, k) in enumerate(zip(first, logit, drafts, strict=True)):
            if caps is not None and caps[r] > 0 and not found[r]:
                continue
            a = 0
            while a < k and ids[f + a] == self.last[g + a]:
                a += 1
            acc[r] = a
        return acc

    def _replay(self, rows, pos: np.ndarray) -> None:
        """Each decode row's logit rows (in row order, 1 + drafts + pad each) take the
        recorded token after their position: what the real model would compute there whenever
        the context is the recorded one (the only positions verification reads)."""
        j = 0
        for row in rows:
            if not row.decode:
                continue
            truth = self.truths.get(row.request.client_id)
            for _ in range(1 + len(row.drafts) + row.pad):
                p = int(pos[j]) + 1
                if truth is not None and p < len(truth):
                    self.last[j] = truth[p]
                j += 1
