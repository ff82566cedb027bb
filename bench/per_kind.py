"""Per prompt kind speed-up of each configuration over `none`, from a bench/serving.py JSON.

Every configuration's server sees the same prompts in a given pass (each server is fresh), so
per kind and pass: tok/s = sum(completion tokens) / sum(request end-to-end seconds), and the
ratio to `none` compares the same requests. Most meaningful at c=1, where requests do not
share steps. With `serving.py --repeat`, a configuration's rounds are pooled.

    python bench/per_kind.py bench/results/round4/final3_serving.json [--passes c=1,c=8]

With `--paired` (a `serving.py --paired` JSON): per configuration, concurrency and kind,
speculation on ÷ off on the same server — the on halves' requests against the off halves'
(each half holds every kind in equal measure, so a kind's ratio compares prompts of that kind,
not the same prompts), all pairs pooled.

    python bench/per_kind.py bench/results/round15/serving_bf16_paired_256.json.gz --paired
"""

from __future__ import annotations

import argparse
import gzip
import json


def per_kind(rounds: list[dict], pass_name: str) -> dict[str, tuple[int, float]]:
    """kind -> (tokens, tok/s over its requests' end-to-end times) in one pass, pooled over
    a configuration's rounds (`serving.py --repeat`)."""
    requests = [
        r for rec in rounds for p in rec["passes"] if p["name"] == pass_name for r in p["requests"]
    ]
    return {
        kind: _rate([r for r in requests if r["kind"] == kind and not r["error"]])
        for kind in sorted({r["kind"] for r in requests})
    }


def _rate(requests: list[dict]) -> tuple[int, float]:
    """(tokens, tok/s over the requests' summed end-to-end times)."""
    tokens = sum(r["tokens"] for r in requests)
    seconds = sum(r["e2e_s"] for r in requests)
    return tokens, tokens / seconds if seconds else 0.0


def paired_per_kind(rounds: list[dict], level: int) -> dict[str, tuple[float, float]]:
    """kind -> (on tok/s, off tok/s) over a configuration's paired passes at concurrency
    `level`, by the requests' end-to-end times."""
    on: dict[str, list[dict]] = {}
    off: dict[str, list[dict]] = {}
    for rec in rounds:
        for p in rec["passes"]:
            if p.get("pair") is None or p["concurrency"] != level:
                continue
            side = on if p["speculate"] else off
            for r in p["requests"]:
                if not r["error"]:
                    side.setdefault(r["kind"], []).append(r)
    return {k: (_rate(on[k])[1], _rate(off[k])[1]) for k in sorted(on) if k in off}


def _paired_main(results: dict[str, list[dict]], levels: list[int]) -> None:
    for level in levels:
        print(f"\nc={level}: speculation on ÷ off per kind, same server (on tok/s / off tok/s)\n")
        configs = [c for c in results if c != "none"]
        print("| kind | " + " | ".join(configs) + " |")
        print("|---" * (len(configs) + 1) + "|")
        rows = {c: paired_per_kind(results[c], level) for c in configs}
        for kind in sorted({k for r in rows.values() for k in r}):
            cells = []
            for c in configs:
                on, off = rows[c].get(kind, (0.0, 0.0))
                cells.append(f"{on / off:.2f}× ({on:.0f} / {off:.0f})" if off else "n/a")
            print(f"| {kind} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json")
    ap.add_argument("--passes", default="c=1")
    ap.add_argument("--paired", action="store_true", help="a serving.py --paired JSON")
    ap.add_argument("--levels", default="1", help="--paired: concurrencies, e.g. 1,8")
    args = ap.parse_args()
    opener = gzip.open if args.json.endswith(".gz") else open
    with opener(args.json, "rt") as f:
        results: dict[str, list[dict]] = {}
        for r in json.load(f)["results"]:
            results.setdefault(r["config"], []).append(r)
    if args.paired:
        _paired_main(results, [int(x) for x in args.levels.split(",")])
        return
    base = results.get("none")
    if base is None:
        raise SystemExit("the JSON has no `none` configuration to compare with")
    for name in args.passes.split(","):
        print(f"\n{name}: tok/s per kind (÷ none)\n")
        kinds = per_kind(base, name)
        print("| kind | " + " | ".join(results) + " |")
        print("|---" * (len(results) + 1) + "|")
        rows = {c: per_kind(r, name) for c, r in results.items()}
        for kind in kinds:
            cells = []
            for c in results:
                tokens, tps = rows[c][kind]
                ratio = tps / kinds[kind][1] if kinds[kind][1] else 0.0
                cells.append(f"{tps:.0f}" + ("" if c == "none" else f" ({ratio:.2f}×)"))
            print(f"| {kind} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
