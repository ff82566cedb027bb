"""Why greedy speculation's output can differ from plain greedy in bf16 (and not in fp32).

For each dtype the same prompts (HumanEval + tests/lossless_prompts.py) run through two
engines over one `LoadedModel`, all prompts at once (continuous batching, CUDA graphs on GPU):
drafter `none` and drafter `ngram` (K drafts). Speculation is lossless in exact arithmetic;
in bf16 the verify step (q = 1 + K rows per request, other batch shapes) rounds differently
from a decode step (q = 1), so a near-tie between the top two logits can flip.

For every output that differs, at its first differing position p we record:
- path gaps: top1 - top2 of the logits each engine actually used at p (recorded by a
  `Verifier` subclass installed on each executor; no extra forward),
- prefill gap: top1 - top2 after one eager ragged prefill of prompt + common prefix (a third
  numeric path, q = prefix length; which token it picks is recorded too),
- fp32 gap: the same prefill with the fp32 model, when float32 is among --dtypes.

    python bench/bf16_divergence.py --device cuda --out DIR      # [--exact auto|on] (default off)
    python bench/bf16_divergence.py --device cpu --model tiny-random --dtypes float32 \
        --num-humaneval 4 --num-lossless 4 --max-new-tokens 16 --out /tmp/div
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_speculation import collect, load_prompts, make_engine  # noqa: E402
from lossless_prompts import lossless_prompts  # noqa: E402

from specwire.common.model.attention import AttentionMetadata  # noqa: E402
from specwire.common.model.llama import LlamaModel  # noqa: E402
from specwire.common.model.loader import LoadedModel, load_model  # noqa: E402
from specwire.target_service.engine import Engine  # noqa: E402
from specwire.target_service.runner.model_runner import StepLogits  # noqa: E402
from specwire.target_service.scheduler import Row  # noqa: E402
from specwire.target_service.verifier import Verified, Verifier  # noqa: E402

BLOCK_SIZE = 16
# (top1 - top2, top1 id, top2 id)
Gap = tuple[float, int, int]


def log(msg: str) -> None:
    print(f"[divergence {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class GapRecorder(Verifier):
    """Verifies as usual, then records the top-2 gap of the logits behind each new token."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size)
        self.gaps: dict[str, dict[int, Gap]] = defaultdict(dict)  # request id -> pos -> gap

    def verify(self, rows: list[Row], step: StepLogits) -> Verified:
        results = super().verify(rows, step)
        requests = [row.request for row in rows]
        top = torch.topk(step.logits, 2, dim=-1)  # values/indices: [N, 2]
        vals, ids = top.values.tolist(), top.indices.tolist()
        for req, (off, _n), toks in zip(requests, step.spans, results.tokens, strict=True):
            first = len(req.output_ids)  # output position of toks[0] (not committed yet)
            for j in range(len(toks)):
                v, i = vals[off + j], ids[off + j]
                self.gaps[req.request_id][first + j] = (v[0] - v[1], i[0], i[1])
        return results


@torch.inference_mode()
def prefill_gap(model: LlamaModel, ids: list[int]) -> Gap:
    """Top-2 gap of the next-token logits after one eager ragged prefill of `ids`."""
    dev = model.embed_tokens.weight.device
    n = len(ids)
    nb = -(-n // BLOCK_SIZE)
    kv = model.allocate_kv_cache(nb + 1)  # [L, 2, nb+1, BS, KVH, D]; block 0 unused
    pos = torch.arange(n, device=dev)  # [n]
    meta = AttentionMetadata(
        slot_mapping=pos + BLOCK_SIZE,  # blocks 1..nb hold positions 0..n-1 in order
        block_tables=torch.arange(1, nb + 1, dtype=torch.int32, device=dev)[None],  # [1, nb]
        context_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        query_lens=[n],
        context_lens_host=[n],
    )
    hidden = model(torch.tensor(ids, device=dev), pos, kv, meta)  # [n, hidden]
    logits = model.compute_logits(hidden[-1:])[0]  # [V]
    v, i = torch.topk(logits, 2)
    return float(v[0] - v[1]), int(i[0]), int(i[1])


def run_dtype(
    loaded: LoadedModel, args: argparse.Namespace, prompts: list[list[int]], max_ctx: int
) -> tuple[list[list[int]], list[list[int]], dict[str, GapRecorder]]:
    """(no-spec outputs, spec outputs, recorders) with all prompts in flight at once."""
    outs: dict[str, list[list[int]]] = {}
    recs: dict[str, GapRecorder] = {}
    for name, k in (("none", 0), ("ngram", args.k)):
        eng: Engine = make_engine(loaded, args, name, k, max_ctx)
        rec = recs[name] = GapRecorder(loaded.config.vocab_size)
        eng.executor.verifier = rec
        t0 = time.perf_counter()
        streams = [
            eng.executor.submit(
                eng.new_request(p, max_new_tokens=args.max_new_tokens, request_id=f"p{i}")
            )
            for i, p in enumerate(prompts)
        ]
        eng.executor.run_until_idle()
        outs[name] = [c.token_ids for c in collect(streams)]
        log(
            f"{args.dtype} {name}: {len(prompts)} prompts in {time.perf_counter() - t0:.1f}s, "
            f"acceptance {eng.executor.stats.acceptance_rate:.2f}"
        )
        eng.shutdown()
    return outs["none"], outs["ngram"], recs


def divergences(
    dtype: str,
    model: LlamaModel,
    prompts: list[list[int]],
    base: list[list[int]],
    spec: list[list[int]],
    recs: dict[str, GapRecorder],
) -> list[dict]:
    """One record per output that differs, at its first differing position."""
    found: list[dict] = []
    for i, (a, b) in enumerate(zip(base, spec, strict=True)):
        if a == b:
            continue
        diff = (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        p = next(diff, min(len(a), len(b)))  # else one output is a prefix of the other
        ng = recs["none"].gaps[f"p{i}"].get(p)
        sg = recs["ngram"].gaps[f"p{i}"].get(p)
        found.append(
            dict(
                dtype=dtype,
                prompt=i,
                pos=p,
                nospec_len=len(a),
                spec_len=len(b),
                nospec_token=a[p] if p < len(a) else None,
                spec_token=b[p] if p < len(b) else None,
                nospec_gap=ng[0] if ng else None,
                nospec_top2=ng[1:] if ng else None,
                spec_gap=sg[0] if sg else None,
                spec_top2=sg[1:] if sg else None,
                common_prefix=a[:p],
                prefill=prefill_gap(model, prompts[i] + a[:p]),
            )
        )
    return found


def summarise(dtype: str, n: int, found: list[dict], nospec: GapRecorder) -> dict:
    gaps = [g[0] for per_req in nospec.gaps.values() for g in per_req.values()]
    at_div = [d["nospec_gap"] for d in found if d["nospec_gap"] is not None]
    return dict(
        dtype=dtype,
        prompts=n,
        identical=n - len(found),
        divergent=len(found),
        median_nospec_gap=statistics.median(at_div) if at_div else None,
        nospec_positions=len(gaps),
        small_gap_positions=sum(g < 0.125 for g in gaps),
    )


def write(
    out: Path,
    args: argparse.Namespace,
    source: str,
    summary: list[dict],
    divergent: list[dict],
    failures: list[str],
) -> str:
    table = markdown(summary, divergent)
    (out / "bf16_divergence.md").write_text(table)
    record = dict(
        args=vars(args),
        prompt_source=source + "+lossless_prompts",
        summary=summary,
        divergent=divergent,
        failures=failures,
    )
    (out / "bf16_divergence.json").write_text(json.dumps(record, indent=1))
    return table


def markdown(summary: list[dict], divergent: list[dict]) -> str:
    lines = [
        "| dtype | prompts | identical | divergent | median no-spec gap at divergence | "
        "no-spec positions with gap < 0.125 |",
        "|---|---|---|---|---|---|",
    ]
    for s in summary:
        lines.append(
            f"| {s['dtype']} | {s['prompts']} | {s['identical']} | {s['divergent']} | "
            f"{_f(s['median_nospec_gap'])} | {s['small_gap_positions']}/"
            f"{s['nospec_positions']} |"
        )
    lines += [
        "",
        "| dtype | prompt | first diff pos | no-spec tok | spec tok | no-spec gap | "
        "spec gap | prefill gap (tok) | fp32 prefill gap (tok) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for d in divergent:
        pf, f32 = d["prefill"], d.get("fp32_prefill")
        lines.append(
            f"| {d['dtype']} | {d['prompt']} | {d['pos']} | {d['nospec_token']} | "
            f"{d['spec_token']} | {_f(d['nospec_gap'])} | {_f(d['spec_gap'])} | "
            f"{pf[0]:.4f} ({pf[1]}) | {f'{f32[0]:.4f} ({f32[1]})' if f32 else 'n/a'} |"
        )
    return "\n".join(lines) + "\n"


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument(
        "--exact",
        default="off",
        choices=("auto", "on", "off"),
        help="the target's exact mode; off (the default here): the divergence it removes",
    )
    ap.add_argument("--num-humaneval", type=int, default=40)
    ap.add_argument("--num-lossless", type=int, default=50)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--max-num-tokens", type=int, default=2048)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    texts, source = load_prompts(args.num_humaneval)
    texts += lossless_prompts(args.num_lossless)
    models: dict[str, LoadedModel] = {}
    summary: list[dict] = []
    divergent: list[dict] = []
    failures: list[str] = []
    for dtype in args.dtypes.split(","):
        args.dtype = dtype  # make_engine reads it
        try:
            loaded = models[dtype] = load_model(
                args.model, device=args.device, dtype=getattr(torch, dtype), progress=False
            )
            prompts = [loaded.tokenizer.encode(t) for t in texts]
            max_ctx = (
                -(-(max(map(len, prompts)) + args.max_new_tokens + args.k + 1) // BLOCK_SIZE)
                * BLOCK_SIZE
            )
            base, spec, recs = run_dtype(loaded, args, prompts, max_ctx)
            here = divergences(dtype, loaded.model, prompts, base, spec, recs)
            summary.append(summarise(dtype, len(prompts), here, recs["none"]))
            divergent += here
            log(f"{dtype}: {len(base) - len(here)}/{len(base)} identical")
        except Exception as exc:  # record and go on with the next dtype
            log(f"{dtype} FAILED: {exc!r}")
            failures.append(f"{dtype}: {exc!r}")
        write(out, args, source, summary, divergent, failures)  # partial results survive a kill
    if "float32" in models:  # the exact-ish reference gap at each divergent prefix
        f32 = models["float32"]
        for d in divergent:
            if d["dtype"] != "float32":
                ids = f32.tokenizer.encode(texts[d["prompt"]])
                d["fp32_prefill"] = prefill_gap(f32.model, ids + d["common_prefix"])
    table = write(out, args, source, summary, divergent, failures)
    print(table, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
