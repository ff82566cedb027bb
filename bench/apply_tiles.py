"""Run a bench script with the exact mode's wide tiles taken from a `gemm_sweep.py --wide
--exact-order` JSON: per swept shape and row count, the fastest configuration whose output
equalled the exact GEMM's, where it beats the current tile of that row range by 3 % or more;
or with small-step tiles (`triton_tiles._TUNED`, both modes' GEMMs of at most 16 rows) given
on the command line. The tables in `triton_tiles` are left as they are; only this process
sees the change. Prints one `PATCH` line per change.

    python3 bench/apply_tiles.py SWEEP.json bench/verify_step.py --device cuda --exact ...
    python3 bench/apply_tiles.py --tuned 4096x4096=32,128,4,4,5 bench/verify_step.py ...
      (N x K = N tile, K tile, K splits, warps, stages; several joined by ';')
"""

from __future__ import annotations

import json
import re
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm_sweep import _wkey  # noqa: E402 (the sweep's names for configs)

from specwire.common.model import triton_tiles as tt  # noqa: E402

KEY = re.compile(r"bm(\d+) bn(\d+) bk(\d+) s(\d+) w(\d+) st(\d+)")  # `_wkey`'s names, read back


def _range(m: int) -> int:
    return next(i for i, max_m in enumerate(tt._RANGES) if m <= max_m)


def chosen_tiles(sweep: list[dict]) -> dict[tuple[int, int, int], tt.WideConfig]:
    chosen = {}
    for r in sweep:
        n, k = r["n"], r["k"]
        exact = tt.linear_config(n, k)
        for row in r["rows"]:
            m = row["m"]
            ok = {c: t for c, t in row["times"].items() if c not in row["exact_order_differ"]}
            best = min(ok, key=ok.get)
            bm, bn, bk, _, w, st = map(int, KEY.match(best).groups())
            current = _wkey(tt.exact_wide_config(n, k, m))
            cur_us = ok.get(current)
            take = cur_us is not None and ok[best] < 0.97 * cur_us
            print(
                f"PATCH {r['model']} {r['op']} ({n},{k}) M={m}: current {current} "
                f"{'-' if cur_us is None else f'{cur_us:.1f}'} us, best {best} {ok[best]:.1f} us "
                f"({len(row['exact_order_differ'])} differ) -> {'take' if take else 'keep'}",
                flush=True,
            )
            if take:
                chosen[(n, k, _range(m))] = tt.WideConfig(
                    bm, bn, bk, exact.split_k, exact.k_per_split, w, st
                )
    return chosen


def patch_tuned(spec: str) -> None:
    """Replace `_TUNED` entries: 'NxK=bn,bk,split,warps,stages;...'."""
    for item in filter(None, spec.split(";")):
        shape, cfg = item.split("=")
        n, k = map(int, shape.split("x"))
        bn, bk, split, warps, stages = map(int, cfg.split(","))
        tt._TUNED[(n, k)] = tt._config(k, bn, bk, split, warps, stages)
        print(f"PATCH _TUNED ({n},{k}) -> {tt._TUNED[(n, k)]}", flush=True)


def main() -> None:
    args = sys.argv[1:]
    if args[0] == "--tuned":
        patch_tuned(args[1])
        args = args[2:]
    if args[0].endswith(".json"):
        sweep_path, script, *rest = args
        chosen = chosen_tiles(json.loads(Path(sweep_path).read_text()))
    else:
        chosen, (script, *rest) = {}, args
    measured = tt.exact_wide_config

    def exact_wide_config(n: int, k: int, m: int) -> tt.WideConfig:
        return chosen.get((n, k, _range(m))) or measured(n, k, m)

    tt.exact_wide_config = exact_wide_config  # what `ops` looks up per call
    sys.argv = [script, *rest]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
