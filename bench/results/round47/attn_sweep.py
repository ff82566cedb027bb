"""Round 47, device call r47a: the paged attention under other launch settings (segment, key
tile, stages, warps, register cap, segments a program), attention + combine per call, timed by
bench/attention_kernel.py's `case` (10 calls a CUDA graph, median of 20 replays)."""

import os
import sys

sys.path.insert(0, "bench")
sys.path.insert(0, ".")
import attention_kernel as ak  # noqa: E402

from specwire.common.model import triton_attention as ta  # noqa: E402

ctx = int(os.environ.get("CTX", 1024))
base_opts = ta.launch_opts
steps = [
    ("llama3-8b", 1, 5, [None]),
    ("llama3-8b", 8, 5, [None]),
    ("llama3-8b", 32, 5, [None, 1]),
    ("llama3-8b", 64, 5, [None, 1]),
    ("smollm2", 1, 1, [None]),
    ("smollm2", 32, 5, [None]),
    ("smollm2", 64, 5, [None]),
]
configs = [  # (segment, key tile, stages, warps, maxnreg)
    (128, 128, 2, 4, None),
    (128, 64, 3, 4, None),
    (128, 64, 2, 4, 128),
    (128, 32, 3, 4, 168),
    (128, 32, 4, 4, 168),
    (128, 32, 3, 4, 128),
    (128, 64, 2, 4, None),
    (128, 64, 4, 4, None),
    (128, 32, 4, 4, None),
    (128, 128, 3, 4, None),
    (256, 64, 3, 4, None),
    (256, 64, 4, 4, None),
]


def one(seg, tile, stages, warps, maxnreg, group, name, b, q):
    ta.SEGMENT, ta.KEY_TILE, ta.NUM_STAGES, ta.NUM_WARPS = seg, tile, stages, warps
    ta.launch_opts = (lambda: {**base_opts(), "maxnreg": maxnreg}) if maxnreg else base_opts
    tag = f"{name} B={b} q={q} seg={seg} tile={tile} st={stages} w={warps} r={maxnreg} g={group}"
    try:
        r = ak.case(ak.HEADS[name], [(q, ctx)] * b, 0, sdpa=False, seg_group=group)
        line = (
            f"{tag}: attn {r['attn_us']:.1f} us {r['kv_gb_per_s']:.0f} GB/s "
            f"diff {r['max_abs_diff']:.1e}"
        )
    except Exception as e:
        line = f"{tag}: FAILED {str(e)[:200]}"
    print(line, flush=True)


for cfg in configs:
    for name, b, q, groups in steps:
        for g in groups:
            one(*cfg, g, name, b, q)
