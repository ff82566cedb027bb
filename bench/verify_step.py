"""Verify-step latency of `ModelRunner.forward` on random weights of real shapes.

For each shape, batch B and draft length K, B decode rows each feed q = 1 + K tokens on top of
`--ctx` tokens already in the paged KV cache. Reported per configuration (median of `--iters`):

- eager ms:   `runner.forward(..., allow_graphs=False)`, host input preparation included
- graph ms:   `runner.forward(...)` replaying a CUDA graph, host input preparation included
              (the real cost of a step: prepare -> copy into static buffers -> replay)
- replay ms:  the captured graph replayed back to back, no input preparation (GPU-only time)
- prep ms:    `runner.prepare(rows, tables)` alone (host lists -> device tensors)
- floor ms:   (weight bytes + KV bytes read) / 4.8 TB/s; the embedding table is not counted
              (only B*q rows of it are read), a tied LM head counts once

`--fused on,off` measures the fused Triton ops (`triton_fused.py`) and the unfused ones on the
same model and cache, one after the other; the table puts them side by side (column "ops").

`--fuse-small on,off` measures the default Triton ops with and without their bit-exact fusions
(steps of at most 16 tokens: SiLU·up in the gate_up GEMM, RoPE + K/V store in the qkv GEMM;
otherwise RoPE in the K/V store. `TritonOps(fuse_small=False)` is the kernel sequence before
them, ops column "...-nofuse"), side by side on the same model and cache. Both give the same
logits bit for bit.

`--small-gemms triton,narrow,cublas` measures the GEMMs on our Triton GEMM with measured tiles
(the default: `triton_tiles._TUNED` at most 16 tokens, `_WIDE` above where it beats cuBLAS,
the exact mode's `exact_wide_config`), on ours at most 16 tokens only ("narrow": cuBLAS above;
in exact mode 64-row mma.sync tiles above), and on cuBLAS (`small_gemms="cublas"`), side by
side (ops column "triton" / "triton-narrow" / "triton-cublas"; the exact mode always runs our
GEMM).

`--compile off,default,max-autotune` (issue 8) adds `torch.compile` of the PyTorch math between
two attention calls (`bench/compiled_ops.py`; "max-autotune" is torch.compile mode
"max-autotune-no-cudagraphs"), on the same model and cache, with the same attention backend;
ops column "compiled-MODE". Inductor's kernels are compiled in the runner's eager warm-up and
captured inside its CUDA graphs. A compiled runner captures only the graph buckets the measured
steps replay (the ones the uncompiled runner would pick): one compile per function and token
count. With compiled variants every row also reports the max abs difference of its logits
(eager, graph) from the uncompiled `TorchOps` model on the same inputs ("max abs diff"; for
the uncompiled Triton ops it is the bf16 noise to compare with).
Compile time on the H200 (fresh caches): "default" ~20 s per shape for 6 token counts;
"max-autotune" ~4 min for llama3-8b with 4 token counts (--batches 1,8 --ks 0,4; ~6 s of
autotuning per GEMM and token count), >5 min for 6. Within a 10-minute run: off,default for
both shapes in one command, max-autotune one shape and at most 4 token counts per command.

Commands: bench/README.md.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compiled_ops import MODES as COMPILE_MODES  # noqa: E402  (bench/, next to this file)
from compiled_ops import CompiledOps, check_logits  # noqa: E402

from specwire.common.model.config import (  # noqa: E402
    LLAMA3_2_1B,
    LLAMA3_8B,
    QWEN2_5_1_5B,
    SMOLLM2_135M,
    SMOLLM2_360M,
    TINY_RANDOM,
    ModelConfig,
)
from specwire.common.model.llama import LlamaModel  # noqa: E402
from specwire.common.model.triton_backend import make_backend, make_ops  # noqa: E402
from specwire.target_service.request import Request  # noqa: E402
from specwire.target_service.resources.kv_cache import KVCacheManager  # noqa: E402
from specwire.target_service.runner.graphs import TokenGraphs  # noqa: E402
from specwire.target_service.runner.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from specwire.target_service.scheduler import Row  # noqa: E402

SHAPES: dict[str, ModelConfig] = {
    "tiny": TINY_RANDOM,
    "smollm2": SMOLLM2_135M,
    "llama3-8b": LLAMA3_8B,
    # Shapes between those two, to measure what the exact mode costs around `--exact auto`'s
    # size line (hidden <= 1024) where its GEMM has no measured tiles, as a user's model would.
    "smollm2-360m": SMOLLM2_360M,
    "qwen2.5-1.5b": QWEN2_5_1_5B,
    "llama3.2-1b": LLAMA3_2_1B,
}
HBM_BYTES_PER_S = 4.8e12
BLOCK_SIZE = 16
# Plain PyTorch decoder under CUDA graphs, ctx 1024 (shared/reference/h200-baselines.md):
# (shape, batch, q) -> graph ms.
PLAIN_GRAPH_MS: dict[tuple[str, int, int], float] = {
    ("llama3-8b", 1, 1): 5.09,
    ("llama3-8b", 1, 5): 6.54,
    ("llama3-8b", 8, 5): 8.14,
    ("llama3-8b", 32, 5): 16.95,
    ("smollm2", 1, 1): 1.28,
    ("smollm2", 1, 5): 2.37,
    ("smollm2", 8, 5): 2.47,
}


def log(msg: str) -> None:
    print(f"[verify_step {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_model(
    cfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_positions: int
) -> LlamaModel:
    """Random weights ~N(0, 0.02) (norms at 1), seeded; built directly in `dtype` on `device`."""
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # no fp32 copy of 8B weights on the way
    try:
        with torch.device(device):
            model = LlamaModel(cfg, block_size=BLOCK_SIZE, max_positions=max_positions)
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("layernorm.weight") and name != "norm.weight":
                p.normal_(0.0, 0.02)
    return model.eval()


def floor_ms(model: LlamaModel, batch: int, ctx: int, kv_dtype: torch.dtype) -> float:
    cfg = model.cfg
    emb = model.embed_tokens.weight
    params = {id(p): p for p in model.parameters()}
    weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
    if not cfg.tie_word_embeddings:  # the lookup table is gathered, not streamed
        weight_bytes -= emb.numel() * emb.element_size()
    elt = torch.tensor([], dtype=kv_dtype).element_size()
    kv_bytes = cfg.num_layers * 2 * ctx * cfg.num_kv_heads * cfg.head_dim * elt * batch
    return (weight_bytes + kv_bytes) / HBM_BYTES_PER_S * 1e3


def make_rows(
    kv: KVCacheManager, batch: int, ctx: int, k: int, vocab: int
) -> tuple[list[Row], list[list[int]]]:
    """`batch` decode rows with `ctx` tokens cached, 1 committed token + `k` drafts each."""
    rows: list[Row] = []
    for i in range(batch):
        req = Request(
            request_id=f"b{batch}k{k}r{i}",
            prompt_ids=[(7 * i + j) % vocab for j in range(ctx + 1)],
            max_new_tokens=k + 2,
            max_draft_len=k,
        )
        req.num_computed = ctx
        kv.reserve(req, ctx + 1 + k)
        drafts = [(3 * i + j + 1) % vocab for j in range(k)]
        rows.append(Row(req, 1, decode=True, drafts=drafts))
    return rows, [kv.block_table(r.request) for r in rows]


def time_ms(
    fn: Callable[[], object], iters: int, device: torch.device, warm: int = 5, per_call: int = 1
) -> float:
    """Median ms of `fn` over `iters` samples, GPU idle at each start (CUDA events on GPU).

    With `per_call` > 1 each sample runs `fn` that many times back to back and is divided."""
    cuda = device.type == "cuda"
    for _ in range(warm):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    samples: list[float] = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(per_call):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / per_call)
        else:
            t0 = time.perf_counter()
            for _ in range(per_call):
                fn()
            samples.append((time.perf_counter() - t0) * 1e3 / per_call)
    return statistics.median(samples)


PROFILE = False  # --profile


def profile_replay(replay: Callable[[], object], label: str, top: int = 12) -> None:
    """Log one graph replay's kernels by device time (the PyTorch profiler sees the kernels
    inside a replayed graph): what separates two variants' replay ms."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    names: collections.Counter = collections.Counter(e.name for e in kernels)
    micros: collections.Counter = collections.Counter()
    for e in kernels:
        micros[e.name] += e.time_range.elapsed_us()
    span = max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
    log(f"profile {label}: {len(kernels)} kernels, {sum(micros.values()):.0f} us busy, "
        f"{span:.0f} us first start to last end")  # fmt: skip
    for kernel, us in micros.most_common(top):
        log(f"  {names[kernel]:5d} {us:9.1f} {us / names[kernel]:7.2f}  {kernel[:90]}")


def measure(
    runner: ModelRunner, rows: list[Row], tables: list[list[int]], iters: int, device: torch.device
) -> tuple[float, float | None, float | None, float, tuple | None]:
    """(eager ms, graph ms, replay ms, prep ms, graph key) for one batch of rows."""
    eager = time_ms(lambda: runner.forward(rows, tables, allow_graphs=False), iters, device)
    graph = replay = None
    prepare = runner.inputs.prepare_varlen if runner.varlen else runner.prepare
    key = runner.graphs.select(prepare(rows, tables)) if runner.graphs else None
    if key is not None:
        graph = time_ms(lambda: runner.forward(rows, tables), iters, device)
        assert runner.forward(rows, tables).graph == key, "forward did not replay the graph"
        replay = time_ms(runner.graphs.graphs[key].replay, iters, device, per_call=5)
        if PROFILE:
            profile_replay(runner.graphs.graphs[key].replay, f"{runner.model.ops.name} {key}")
    prep = time_ms(lambda: prepare(rows, tables), iters, device)  # host work, GPU idle
    return eager, graph, replay, prep, key


def build_runners(
    model: LlamaModel,
    kv_caches: torch.Tensor,
    args: argparse.Namespace,
    graphs: bool,
    name: str,
    only_used_buckets: bool = False,
) -> dict[int, ModelRunner]:
    """One warm runner per distinct draft length > 0 (its logits buffer is sized for 1 + K
    rows), its CUDA graphs captured with the model's current ops. `only_used_buckets`: capture
    only the buckets the measured steps (B * (1 + K) tokens) replay (compiled ops: one compile
    per token count)."""
    max_k, max_b = max(args.ks), max(args.batches)
    runners: dict[int, ModelRunner] = {}
    for k in sorted({k for k in args.ks if k > 0} or {0}):
        t0 = time.perf_counter()
        runners[k] = ModelRunner(
            model,
            kv_caches,
            RunnerConfig(
                max_batch_size=max_b,
                max_draft_len=k,
                max_context_len=args.max_context_len or args.ctx + max_k + BLOCK_SIZE,
                block_size=BLOCK_SIZE,
                dummy_block=KVCacheManager.DUMMY_BLOCK,
                cuda_graphs=graphs,
                max_num_tokens=max_b * (1 + max_k),
            ),
        )
        if only_used_buckets and runners[k].graphs is not None:
            g = runners[k].graphs
            used = {b * (1 + kk) for b in args.batches for kk in args.ks}
            g.buckets = sorted({min(x for x in g.buckets if x >= t) for t in used})
        runners[k].warmup(progress=False)
        n = len(runners[k].graphs.graphs) if runners[k].graphs else 0
        log(f"{name}: runner K={k} warm, {n} graphs captured in {time.perf_counter() - t0:.1f}s")
    return runners


def measure_case(
    name: str,
    model: LlamaModel,
    kv: KVCacheManager,
    runner: ModelRunner,
    batch: int,
    k: int,
    mode: str,
    compiled: CompiledOps | None,
    args: argparse.Namespace,
) -> dict:
    """One (batch, K) configuration with the model's current ops: latencies, floor and, with
    --compile, the logits' difference from the torch ops."""
    device = runner.device
    rows, tables = make_rows(kv, batch, args.ctx, k, model.cfg.vocab_size)
    q = 1 + k
    diff = {}
    if args.compile != ["off"]:  # every variant's logits against the torch ops
        diff = check_logits(model, compiled, runner, rows, tables)
    eager, graph, replay, prep, key = measure(runner, rows, tables, args.iters, device)
    fl = floor_ms(model, batch, args.ctx, runner.kv_caches.dtype)
    log(
        f"{name} [{model.ops.name}] B={batch} q={q}: eager {eager:.3f} ms, "
        f"graph {_f(graph)} ms, replay {_f(replay)} ms, prep {prep:.3f} ms, floor {fl:.3f} ms"
        + (
            f", max abs diff vs torch ops: eager {diff['max_abs_diff_eager']:.3g}, "
            f"graph {_g(diff['max_abs_diff_graph'])} (max |logit| "
            f"{diff['ref_max_abs_logit']:.3g})"
            if diff
            else ""
        )
    )
    for r in rows:
        kv.free(r.request)
    return dict(
        shape=name,
        ops=model.ops.name,
        compile=mode,
        batch=batch,
        q=q,
        k=k,
        ctx=args.ctx,
        dtype=str(model.embed_tokens.weight.dtype).removeprefix("torch."),
        eager_ms=eager,
        graph_ms=graph,
        replay_ms=replay,
        prep_ms=prep,
        floor_ms=fl,
        graph_bucket=key,
        graph_over_floor=graph / fl if graph else None,
        plain_pytorch_graph_ms=PLAIN_GRAPH_MS.get((name, batch, q)),
        **diff,
    )


def bench_shape(
    name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> list[dict]:
    cfg = SHAPES[name]
    max_k = max(args.ks)
    max_ctx = args.ctx + max_k + BLOCK_SIZE
    max_b = max(args.batches)
    t0 = time.perf_counter()
    model = build_model(cfg, device, dtype, max_positions=max_ctx + BLOCK_SIZE)
    log(f"{name}: built random {dtype} model in {time.perf_counter() - t0:.1f}s")
    blocks_per_row = -(-(args.ctx + 1 + max_k) // BLOCK_SIZE)
    kv = KVCacheManager(max_b * blocks_per_row + 1, BLOCK_SIZE, max_k)
    kv_caches = model.allocate_kv_cache(kv.num_blocks)  # [L, 2, NB, BS, KVH, D]
    graphs = device.type == "cuda" and not args.no_cuda_graphs
    model.set_attention(make_backend(args.attention, model, device))
    results: list[dict] = []
    measured: set[str] = set()
    # (fused, small GEMMs, bit-exact fusions, compile mode) in turn
    variants: list[tuple[bool, str, bool, tuple[bool, bool], bool, str]] = []
    for mode in args.compile:
        if mode != "off":
            variants.append((False, "triton", True, (True, True), True, mode))
            continue
        variants += [
            (f, g, s, p, nrm, mode)
            for f in args.fused
            for g in args.small_gemms
            for s in args.fuse_small
            for p in args.pdl
            for nrm in args.fuse_norm
        ]
    # each variant once per graph row layout (`TokenGraphs.trim_rows`) and attention segment
    # grouping
    variants = [
        v + (trim, g, am)
        for trim in args.graph_rows
        for g in args.seg_group_max
        for am in args.argmax
        for v in variants
    ]
    for fused, small_gemms, fuse_small, pdl, fuse_norm, mode, trim, seg_max, am in variants:
        TokenGraphs.trim_rows = trim
        TokenGraphs.triton_argmax = am == "triton"
        tag = "" if trim else "-fullrows"
        tag += "-torchargmax" if am == "torch" else ""
        if seg_max is not None:
            from specwire.common.model import triton_attention  # needs Triton: only when asked

            triton_attention.SEG_GROUP_MAX = seg_max
            tag += f"-seg{seg_max}" if len(args.seg_group_max) > 1 else ""
        compiled = None
        if mode == "off":
            ops = make_ops(
                model.attention,
                args.exact,
                fused,
                small_gemms,
                fuse_small,
                pdl[0],
                fuse_norm,
                pdl_early=pdl[1],
            )
            model.set_ops(ops)
        else:
            compiled = CompiledOps(model, mode)
            compiled.attach()
        if model.ops.name + tag in measured:  # e.g. exact or SDPA: fusion does not apply
            continue
        measured.add(model.ops.name + tag)
        log(f"{name}: attention backend {model.attention.name}, ops {model.ops.name}")
        t0 = time.perf_counter()
        runners = build_runners(
            model, kv_caches, args, graphs, name, only_used_buckets=compiled is not None
        )
        if compiled is not None:
            log(
                f"{name}: {model.ops.name}: warm-up, compiles included, "
                f"{time.perf_counter() - t0:.1f}s"
            )
        for batch in args.batches:
            for k in args.ks:
                runner = runners[k] if k in runners else next(iter(runners.values()))
                result = measure_case(name, model, kv, runner, batch, k, mode, compiled, args)
                result["ops"] += tag
                results.append(result)
        del runners  # their graphs and pools, before the next variant captures its own
        if compiled is not None:
            compiled.detach()
            del compiled
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    kv.check_integrity()
    del kv_caches, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def _f(x: float | None, nd: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def _g(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def markdown(results: list[dict]) -> str:
    # With --compile: each variant's max abs logit difference from the torch ops (eager / graph).
    diffs = any("max_abs_diff_eager" in r for r in results)
    lines = [
        "| shape | ops | batch | q | eager ms | graph ms | replay ms (GPU) | prep ms (host) "
        "| floor ms | graph ÷ floor | plain PyTorch graph ms |"
        + (" max abs diff (eager / graph) |" if diffs else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if diffs else ""),
    ]
    # The ops variants of one configuration side by side.
    for r in sorted(results, key=lambda r: (r["shape"], r["batch"], r["q"])):
        diff = ""
        if diffs:
            diff = " |"
            if "max_abs_diff_eager" in r:
                diff = f" {_g(r['max_abs_diff_eager'])} / {_g(r['max_abs_diff_graph'])} |"
        lines.append(
            f"| {r['shape']} | {r['ops']} | {r['batch']} | {r['q']} | {r['eager_ms']:.2f} | "
            f"{_f(r['graph_ms'], 2)} | {_f(r['replay_ms'], 2)} | {r['prep_ms']:.2f} | "
            f"{r['floor_ms']:.2f} | {_f(r['graph_over_floor'], 1)} | "
            f"{_f(r['plain_pytorch_graph_ms'], 2)} |" + diff
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="smollm2,llama3-8b")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--ks", default="0,4")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument(
        "--max-context-len",
        type=int,
        default=0,
        help="the runner's max context, which sets the block tables' width and so the attention "
        "grid's segment axis (0: just enough for --ctx; the target's default is 2048)",
    )
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--attention", default="auto", help="auto | triton | sdpa")
    ap.add_argument("--exact", action="store_true", help="batch-invariant GEMMs (--exact)")
    ap.add_argument(
        "--fused",
        default="off",
        choices=("off", "on", "on,off", "off,on"),
        help="fused Triton ops for small steps (the target's --fused): off (the default) | on "
        "| on,off (both, side by side)",
    )
    ap.add_argument(
        "--compile",
        default="off",
        help="comma list of off | default | max-autotune: torch.compile of the PyTorch math "
        "between attention calls (bench/compiled_ops.py; max-autotune = mode "
        "max-autotune-no-cudagraphs), side by side; off (the default): uncompiled only",
    )
    ap.add_argument(
        "--small-gemms",
        default="triton",
        help="comma list of triton | narrow | cublas: who runs the GEMMs (bf16), side by side: "
        "triton (the default, what the target runs): our GEMM at <= 16 tokens and where "
        "measured wide tiles beat cuBLAS, and the exact mode's wide tiles; narrow: our GEMM "
        "only at <= 16 tokens (the exact mode: 64-row mma.sync tiles above); cublas",
    )
    ap.add_argument(
        "--fuse-small",
        default="on",
        choices=("on", "off", "on,off", "off,on"),
        help="the Triton ops' bit-exact fusions (SiLU·up in the gate_up GEMM, RoPE and the KV "
        "store in the qkv GEMM or in one kernel): on (the default, what the target runs) | off "
        "(the kernels before them) | on,off (both, side by side)",
    )
    ap.add_argument(
        "--pdl",
        default="on",
        help="programmatic dependent launch of the Triton kernels (sm_90+), a comma list of: "
        "on (the default, what the target runs: norm weights and attention metadata loaded "
        "before each kernel's wait) | late (nothing before the wait; ops column "
        "'...-pdllate') | off ('...-nopdl'), side by side",
    )
    ap.add_argument(
        "--fuse-norm",
        default="off",
        choices=("on", "off", "on,off", "off,on"),
        help="the RMSNorms in the qkv and gate_up GEMMs' prologues, where bit-exact (with "
        "--fuse-small on): off (the default, what the target runs) | on | on,off (ops column "
        "'...-norm')",
    )
    ap.add_argument(
        "--graph-rows",
        default="trim",
        help="comma list of trim | full: a graph bucket of T tokens attends over min(T, max "
        "rows) rows (trim, what the target runs) or the largest batch's rows (full: the layout "
        "before round 17; ops column '...-fullrows'), side by side",
    )
    ap.add_argument(
        "--seg-group-max",
        default="",
        help="comma list: the most key segments one Triton attention program walks "
        "(triton_attention.SEG_GROUP_MAX; 1: one segment a program), side by side (ops column "
        "'...-segN'); the numerics are the same. Default: the module's",
    )
    ap.add_argument(
        "--argmax",
        default="triton",
        help="comma list of triton | torch: the graph's logits copy and greedy argmax as our "
        "two launches (triton_argmax, what the target runs) or PyTorch's copy and argmax "
        "(torch: before round 28; ops column '...-torchargmax'), side by side",
    )
    ap.add_argument(
        "--seg-group-floor",
        type=int,
        default=-1,
        help="triton_attention.GROUP_ROW_HEADS for this run: the fewest (row, KV head) pairs a "
        "step's grid needs before segments are grouped (-1: the module's)",
    )
    ap.add_argument(
        "--no-exact-cublas",
        action="store_true",
        help="the exact mode's wide GEMMs stay on our tiles even where cuBLAS gives their bits "
        "(TritonOps.exact_cublas off: the exact mode before round 22)",
    )
    ap.add_argument(
        "--no-defer-splits",
        action="store_true",
        help="K-split GEMMs sum their partials in their own launch, not in the next norm's "
        "(TritonOps.defer_splits off: before round 23)",
    )
    ap.add_argument(
        "--masked-k",
        action="store_true",
        help="our GEMMs mask their K loads as before round 21 (triton_ops.UNMASKED_K off)",
    )
    ap.add_argument(
        "--profile", action="store_true", help="log each graph replay's kernels by device time"
    )
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    global PROFILE
    PROFILE = args.profile
    if args.masked_k:
        from specwire.common.model import triton_ops

        triton_ops.UNMASKED_K = False
    from specwire.common.model.ops import TritonOps

    TritonOps.exact_cublas = not args.no_exact_cublas
    TritonOps.defer_splits = not args.no_defer_splits
    if args.threads:
        torch.set_num_threads(args.threads)
    args.batches = [int(x) for x in args.batches.split(",")]
    if not set(args.graph_rows.split(",")) <= {"trim", "full"}:
        ap.error(f"--graph-rows takes a comma list of trim, full, not {args.graph_rows!r}")
    args.graph_rows = [x == "trim" for x in args.graph_rows.split(",")]
    args.seg_group_max = [int(x) for x in args.seg_group_max.split(",") if x] or [None]
    args.argmax = args.argmax.split(",")
    if not set(args.argmax) <= {"triton", "torch"}:
        ap.error(f"--argmax: triton or torch, not {args.argmax}")
    if args.seg_group_floor >= 0:
        from specwire.common.model import triton_attention  # needs Triton: only when asked

        triton_attention.GROUP_ROW_HEADS = args.seg_group_floor
    args.ks = [int(x) for x in args.ks.split(",")]
    args.fused = [{"on": True, "off": False}[x] for x in args.fused.split(",")]
    args.fuse_small = [{"on": True, "off": False}[x] for x in args.fuse_small.split(",")]
    pdl_modes = {"on": (True, True), "late": (True, False), "off": (False, True)}
    if not set(args.pdl.split(",")) <= set(pdl_modes):
        ap.error(f"--pdl takes a comma list of {', '.join(pdl_modes)}, not {args.pdl!r}")
    args.pdl = [pdl_modes[x] for x in args.pdl.split(",")]
    args.fuse_norm = [{"on": True, "off": False}[x] for x in args.fuse_norm.split(",")]
    args.compile = [x.strip() for x in args.compile.split(",") if x.strip()]
    args.small_gemms = [x.strip() for x in args.small_gemms.split(",") if x.strip()]
    if not args.small_gemms or set(args.small_gemms) - {"triton", "narrow", "cublas"}:
        ap.error("--small-gemms: use a comma list of triton, narrow, cublas")
    bad = [x for x in args.compile if x != "off" and x not in COMPILE_MODES]
    if bad or not args.compile:
        ap.error(f"--compile: use a comma list of off, {', '.join(COMPILE_MODES)} (got {bad})")
    if args.exact and args.compile != ["off"]:
        ap.error("--compile compiles the plain PyTorch ops: not with --exact")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(
        torch=torch.__version__,
        device=str(device),
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        threads=torch.get_num_threads(),
    )
    log(f"env {env}")
    results: list[dict] = []
    failures: list[str] = []
    for name in args.shapes.split(","):
        try:
            results += bench_shape(name, args, device, dtype)
        except Exception as exc:  # record and go on to the next shape
            log(f"{name} FAILED: {exc!r}")
            failures.append(f"{name}: {exc!r}")
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        table = markdown(results)
        (out / f"verify_step{args.tag}.json").write_text(
            json.dumps(dict(env=env, args=vars(args), results=results, failures=failures), indent=1)
        )
        (out / f"verify_step{args.tag}.md").write_text(table)
    print(table, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
