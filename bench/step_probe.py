"""Print what `bench/step_probe/sitecustomize.py` recorded in serving targets: per target
process (its drafter), the mean time per call of each executor phase in synchronous (drafting)
steps and in overlapped plain steps, the phases' share of a synchronous step, and the draft
policy's estimates at its one-stream drafting decisions.

    PYTHONPATH=bench/step_probe:$PYTHONPATH SPECWIRE_STEP_PROBE=DIR python bench/serving.py ...
    python bench/step_probe.py DIR
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics


def report(path: str) -> str:
    with open(path, encoding="ascii") as f:
        data = json.load(f)
    lines = [f"### pid {data['pid']}: {data['drafter']} ({data['steps']} steps)", ""]
    sync = data["phases"].get("sync", {})
    plain = data["phases"].get("plain", {})
    steps = sync.get("step", [0.0, 0])[1]
    lines.append("| phase | sync: us/call | calls/sync step | us/sync step | plain: us/call |")
    lines.append("|---|---|---|---|---|")
    for name in sorted(set(sync) | set(plain)):
        s_t, s_n = sync.get(name, [0.0, 0])
        p_t, p_n = plain.get(name, [0.0, 0])
        per_call = f"{1e6 * s_t / s_n:.1f}" if s_n else "–"
        calls = f"{s_n / steps:.2f}" if steps else "–"
        per_step = f"{1e6 * s_t / steps:.1f}" if steps else "–"
        p_call = f"{1e6 * p_t / p_n:.1f}" if p_n else "–"
        lines.append(f"| {name} | {per_call} | {calls} | {per_step} | {p_call} |")
    rows = data["policy"]
    if rows:
        drafting = sum(1 for r in rows if r[3] > 0)
        lines += [
            "",
            f"One-stream decisions in the speculative mode: {len(rows)}, k > 0 in {drafting}"
            f" ({100 * drafting / len(rows):.0f} %); policy host estimate p50"
            f" {1e3 * statistics.median(r[0] for r in rows):.3f} ms; p (has a draft) mean"
            f" {statistics.mean(r[1] for r in rows):.2f}; a (per-draft acceptance) mean"
            f" {statistics.mean(r[2] for r in rows):.2f}",
        ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    args = ap.parse_args()
    for path in sorted(glob.glob(os.path.join(args.dir, "*.json"))):
        print(report(path), end="\n\n")


if __name__ == "__main__":
    main()
