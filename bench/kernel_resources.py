"""What the paged-attention kernels compile to on Hopper, without a GPU: registers, spills,
shared memory, programs per SM, the MMA generation, and how deep the K/V loads are pipelined.

Triton's own compiler builds the kernels for sm_90 (it carries `ptxas` and `cuobjdump`), with
the argument specialisations a launch at the reference models' shapes gets (16-byte aligned
pointers, strides divisible by 16), so the figures equal what the GPU host reports for the same
Triton (checked against round 20's `attention_regs.log`: 248 / 223 registers, 81,920 bytes of
shared memory). A launch setting that changes no bit (stages, `maxnreg`) or one that does (key
tile, segment) can be looked at before any device time is spent on it.

    python bench/kernel_resources.py [--tiles 128,64] [--stages 2,3] [--maxnreg 0,168] [--out DIR]

Needs Triton (not a dependency of the package; `make test-interpret` installs it into
`.triton-cpu`): `PYTHONPATH=.triton-cpu python bench/kernel_resources.py`.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Hopper (sm_90) per-SM limits
SM_REGS = 65536
SM_SMEM = 233472  # 228 KB a multiprocessor shares among its programs
SMEM_RESERVED = 1024  # the system's share of each program's shared memory
SM_WARPS = 64
SM_PROGRAMS = 32
REG_UNIT = 256  # registers are allocated per warp in units of this many

# (query heads, KV heads, head dim) of the reference models
HEADS = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}


@dataclass
class Resources:
    regs: int  # per thread
    stack: int  # bytes per thread of local memory (spills, when the code needs no stack)
    shared: int  # bytes per program
    warps: int

    def programs_per_sm(self) -> tuple[int, str]:
        """How many programs an SM holds, and what limits it (regs, smem, warps)."""
        per_warp = -(-self.regs * 32 // REG_UNIT) * REG_UNIT
        by_regs = (SM_REGS // per_warp) // self.warps
        by_smem = SM_SMEM // (self.shared + SMEM_RESERVED)
        by_warps = min(SM_WARPS // self.warps, SM_PROGRAMS)
        limits = {"regs": by_regs, "smem": by_smem, "warps": by_warps}
        least = min(limits.values())
        return least, next(k for k, v in limits.items() if v == least)


def pipeline_facts(ttgir: str) -> dict:
    """From the TTGIR: the MMA generation (2: mma.sync, operands through registers; 3: wgmma,
    B from shared memory), whether the K/V loads are asynchronous copies, and the buffers
    each of them rotates through (1: the next tile's load is issued after this tile's math)."""
    versions = re.findall(r"nvidia_mma<\{versionMajor = (\d+)", ttgir)
    buffers = [int(n) for n in re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x", ttgir)]
    return {
        "mma": int(versions[0]) if versions else 0,
        "async": "async_copy_global_to_local" in ttgir,
        "buffers": max(buffers) if buffers else 0,
    }


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def cubin_resources(cubin: bytes, warps: int, shared: int) -> Resources:
    """Registers and stack from the cubin (`cuobjdump`); `shared`: the kernel's dynamic shared
    memory, which Triton's metadata holds (cuobjdump's SHARED counts only the static part)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [_tool("cuobjdump"), "--dump-resource-usage", f.name],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", text)
    if m is None:
        raise RuntimeError(f"no resource line in cuobjdump's output: {text[-300:]}")
    return Resources(int(m.group(1)), int(m.group(2)), shared, warps)


def compile_attention(
    heads: tuple[int, int, int],
    grouped: bool,
    tile: int,
    stages: int,
    maxnreg: int = 0,
    segment: int | None = None,
) -> tuple[Resources, dict]:
    """Compile `_paged_attention_kernel` for sm_90 as `paged_attention` launches it in bf16 at
    these heads (one segment a program, or GROUPED), with this key tile and pipeline depth."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specwire.common.model import triton_base

    # The kernels carry PDL's grid dependency control only where a GPU of sm_90 says so; the
    # code compiled here is the GPU host's.
    triton_base._GDC = tl.constexpr(True)
    from specwire.common.model import triton_attention as ta

    h, kvh, d = heads
    group = h // kvh
    group_p = triton.next_power_of_2(group)
    sig = {
        "q_ptr": "*bf16", "cache_ptr": "*bf16", "bt_ptr": "*i32", "cu_ptr": "*i32",
        "seq_ptr": "*i32", "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
        "nseg_ptr": "*i32", "qk_scale": "fp32", "num_tokens": "i32", "num_rows": "i32",
        "num_heads": "i32", "stride_qt": "i32", "stride_qh": "i32", "stride_ckv": "i64",
        "stride_cb": "i32", "stride_cs": "i32", "stride_ch": "i32", "stride_bt": "i32",
        "table_width": "i32", "block_size": "i32", "head_dim": "i32", "group": "i32",
    }  # fmt: skip
    consts = {
        "BLOCK_Q": max(1, ta.TILE_ROWS // group_p),
        "GROUP_P": group_p,
        "BLOCK_D": triton.next_power_of_2(d),
        "TILE": tile,
        "SEGMENT": segment or ta.SEGMENT,
        "FANOUT": ta.SEARCH_FANOUT,
        "DOT_PRECISION": "tf32",
        "EARLY": True,
        "GROUPED": grouped,
    }
    names = list(sig) + list(consts)
    sig.update({k: "constexpr" for k in consts})
    # What a launch specialises at these shapes: pointers 16-byte aligned, and the strides, the
    # block size, head size and head count divisible by 16 (not `group`: 3 and 4 here; not the
    # lengths, which the kernel marks do_not_specialize).
    div16 = [n for n in sig if sig[n].startswith("*")] + [
        "stride_qt", "stride_qh", "stride_ckv", "stride_cb", "stride_cs", "stride_ch",
        "stride_bt", "block_size", "head_dim",
    ]  # fmt: skip
    if h % 16 == 0:
        div16.append("num_heads")
    src = ASTSource(
        fn=ta._paged_attention_kernel,
        signature=sig,
        constexprs={(names.index(k),): v for k, v in consts.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in div16},
    )
    options = {"num_warps": ta.NUM_WARPS, "num_stages": stages, "enable_fp_fusion": ta.FP_FUSION}
    if maxnreg:
        options["maxnreg"] = maxnreg
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    res = cubin_resources(kernel.asm["cubin"], ta.NUM_WARPS, kernel.metadata.shared)
    return res, pipeline_facts(kernel.asm["ttgir"])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="smollm2,llama3-8b")
    ap.add_argument("--tiles", default="", help="key tiles, e.g. 128,64 ('': the module's)")
    ap.add_argument("--stages", default="", help="pipeline depths, e.g. 2,3 ('': the module's)")
    ap.add_argument("--maxnreg", default="0", help="register caps, e.g. 0,168 (0: none)")
    ap.add_argument("--out", help="folder for kernel_resources.md")
    args = ap.parse_args()
    try:
        import triton  # noqa: F401
    except ImportError:
        print("needs Triton: PYTHONPATH=.triton-cpu (make test-interpret installs it)")
        return 2
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="kernel_resources_"))
    from specwire.common.model import triton_attention as ta

    def ints(text: str, default: int) -> list[int]:
        return [int(x) for x in text.split(",") if x] or [default]

    lines = [
        "sm_90, bf16; programs/SM = min(registers, shared memory, warps) at "
        f"{SM_REGS} registers, {SM_SMEM} bytes and {SM_WARPS} warps an SM",
        "",
        "| heads | path | key tile | stages | maxnreg | registers | stack B | shared B "
        "| programs/SM (limit) | MMA | K/V async | K/V buffers |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape in args.shapes.split(","):
        for tile in ints(args.tiles, ta.KEY_TILE):
            for stages in ints(args.stages, ta.NUM_STAGES):
                for maxnreg in ints(args.maxnreg, 0):
                    for grouped in (False, True):
                        res, facts = compile_attention(HEADS[shape], grouped, tile, stages, maxnreg)
                        n, limit = res.programs_per_sm()
                        lines.append(
                            f"| {shape} | {'grouped' if grouped else 'one segment'} | {tile} | "
                            f"{stages} | {maxnreg or '-'} | {res.regs} | {res.stack} | "
                            f"{res.shared} | {n} ({limit}) | v{facts['mma']} | "
                            f"{'yes' if facts['async'] else 'no'} | {facts['buffers']} |"
                        )
                        print(lines[-1], flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "kernel_resources.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
