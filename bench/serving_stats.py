"""Client-side measurements of one serving pass, and their markdown tables (bench/serving.py).

Times are `time.perf_counter()` seconds on the client. For one request:

- TTFT: send -> arrival of the first chunk that holds tokens.
- ITL (inter-token latency): for each later chunk i with n_i tokens, arriving g_i seconds after
  the previous chunk, every one of its n_i tokens gets the latency g_i / n_i (speculation
  delivers several tokens per chunk, and they arrive together). The pass's ITL percentiles are
  over all such tokens of all requests (token-weighted); the first chunk's tokens are in TTFT.
- TPOT: (last chunk - first chunk) / (tokens after the first chunk): the token-weighted mean
  of that request's ITL.
- E2E: send -> the GenerateComplete message.
- server TTFT: the target's own `time_to_first_token_s` (arrival -> first token, its clock), to
  tell server time from transport and client time.

All client times are when the client's event loop reads the message. Tokens a server delivers
in a burst (its gRPC thread behind the executor) show as ITL ~0 followed by one long gap: that
is what a client sees, so it is reported as is.

Pass figures: output tok/s = completion tokens of the requests that completed / wall time of
the pass (first send -> last reply); acceptance = sum accepted / sum drafted, and mean accepted
length = (sum accepted + sum steps) / sum steps, both from each GenerateComplete's
`speculation` stats.

Steady tok/s: the pass keeps c requests in flight, but it ramps up (until c requests stream)
and drains (once the last prompt is sent, fewer than c remain), and on a short pass those ends
dominate tok/s. The steady window is [t_a, t_b]: t_a = arrival of the c-th earliest first
token of the pass's requests (all c slots streaming), t_b = the send of the pass's last
prompt. Steady tok/s = tokens of the completed requests in chunks arriving within the window
÷ (t_b - t_a); n/a (with the reason) when the window is shorter than STEADY_MIN_S or holds
fewer than STEADY_MIN_CHUNKS chunks, where one chunk more or less moves the figure.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np
from policy_stats import policy_table
from prompt_pool import ALL_KINDS


@dataclass
class RequestRecord:
    prompt_id: str
    kind: str
    sent: float = 0.0
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens), tokens > 0
    done: float | None = None  # arrival of GenerateComplete
    server_ttft: float | None = None  # GenerateComplete.time_to_first_token_s (server clock)
    completion_tokens: int = 0
    finish: str = ""
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.done is not None

    def itl(self) -> list[tuple[float, int]]:
        """[(seconds per token, tokens)] for each chunk after the first."""
        return [((t - t_prev) / n, n) for (t_prev, _), (t, n) in pairwise(self.chunks)]

    def to_json(self) -> dict:
        first = self.chunks[0][0] - self.sent if self.chunks else None
        return dict(
            id=self.prompt_id,
            kind=self.kind,
            ttft_s=first,
            server_ttft_s=self.server_ttft,
            e2e_s=self.done - self.sent if self.done is not None else None,
            tokens=self.completion_tokens,
            chunks=len(self.chunks),
            finish=self.finish,
            steps=self.steps,
            drafted=self.drafted,
            accepted=self.accepted,
            error=self.error,
        )


def _pct(values: list[float], q: float, weights: list[int] | None = None) -> float | None:
    if not values:
        return None
    if weights is None:
        return float(np.percentile(values, q))
    return float(np.percentile(np.repeat(values, weights), q))


def summarise(records: list[RequestRecord], wall_s: float | None) -> dict:
    """Figures for a set of requests; tok/s and req/s only when `wall_s` (a whole pass)."""
    ok = [r for r in records if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    ttft = [r.chunks[0][0] - r.sent for r in ok if r.chunks]
    itl = [x for r in ok for x in r.itl()]
    tpot = [
        (r.chunks[-1][0] - r.chunks[0][0]) / (sum(n for _, n in r.chunks[1:]))
        for r in ok
        if len(r.chunks) > 1
    ]
    e2e = [r.done - r.sent for r in ok]
    steps = sum(r.steps for r in ok)
    drafted = sum(r.drafted for r in ok)
    accepted = sum(r.accepted for r in ok)
    errors = [r.error for r in records if not r.ok]
    return dict(
        requests=len(records),
        completed=len(ok),
        errors=len(errors),
        error_samples=sorted(set(e or "no completion" for e in errors))[:5],
        completion_tokens=tokens,
        wall_s=wall_s,
        tok_per_s=tokens / wall_s if wall_s else None,
        req_per_s=len(ok) / wall_s if wall_s else None,
        ttft_p50_s=_pct(ttft, 50),
        ttft_p99_s=_pct(ttft, 99),
        server_ttft_p50_s=_pct([r.server_ttft for r in ok if r.server_ttft is not None], 50),
        itl_p50_s=_pct([v for v, _ in itl], 50, [n for _, n in itl]),
        itl_p99_s=_pct([v for v, _ in itl], 99, [n for _, n in itl]),
        tpot_p50_s=_pct(tpot, 50),
        e2e_p50_s=_pct(e2e, 50),
        e2e_p99_s=_pct(e2e, 99),
        decode_steps=steps,
        drafted=drafted,
        accepted=accepted,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        mean_accepted_length=(accepted + steps) / steps if steps else None,
        chunks_per_request=sum(len(r.chunks) for r in ok) / len(ok) if ok else None,
        finish_reasons=dict(Counter(r.finish for r in ok)),
    )


STEADY_MIN_S = 0.2  # shorter steady windows are n/a
STEADY_MIN_CHUNKS = 20  # so are windows holding fewer chunks


def steady_state(records: list[RequestRecord], concurrency: int) -> dict:
    """Tokens/s with all `concurrency` slots busy: ramp-up and drain left out (module doc)."""
    firsts = sorted(r.chunks[0][0] for r in records if r.chunks)
    if len(firsts) < concurrency:
        na = f"only {len(firsts)} of c={concurrency} requests streamed"
        return dict(steady_tok_s=None, steady_s=None, steady_chunks=0, steady_na=na)
    t_a, t_b = firsts[concurrency - 1], max(r.sent for r in records)
    inside = [n for r in records if r.ok for t, n in r.chunks if t_a <= t <= t_b]
    span = max(t_b - t_a, 0.0)  # 0: the last prompt went out before all c streamed
    na = None
    if span < STEADY_MIN_S:
        na = f"window {span:.3f}s < {STEADY_MIN_S}s"
    elif len(inside) < STEADY_MIN_CHUNKS:
        na = f"{len(inside)} chunks < {STEADY_MIN_CHUNKS}"
    return dict(
        steady_tok_s=None if na else sum(inside) / span,
        steady_s=span,
        steady_chunks=len(inside),
        steady_na=na,
    )


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{1000 * x:.1f}"


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _delta(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0f}"


def _busy(p: dict) -> str:
    """The share of the pass's wall time the GPU spent running its steps."""
    gpu, wall = p.get("gpu_s"), p.get("wall_s")
    return f"{gpu / wall:.0%}" if gpu and wall else "n/a"


def _steady(p: dict) -> str:
    """Steady tok/s over its window's length, or n/a over the window's length."""
    span = p.get("steady_s")
    return f"{_f(p.get('steady_tok_s'), '.1f')} ({_f(span)}s)" if span is not None else "n/a"


def pass_table(passes: list[dict]) -> str:
    """One row per pass of one configuration."""
    lines = [
        "| pass | c | reqs | tokens | tok/s | steady tok/s | req/s | TTFT p50 ms | TTFT p99 ms | "
        "srv TTFT p50 ms | ITL p50 ms | "
        "ITL p99 ms | TPOT p50 ms | E2E p50 s | acceptance | mean acc len | eager steps | "
        "steps | overlapped | step ms | host ms/step | GPU ms/step | GPU busy | errors |",
        "|---" * 24 + "|",
    ]
    for p in passes:
        s = p["summary"]
        lines.append(
            f"| {p['name']} | {p['concurrency']} | {s['requests']} | {s['completion_tokens']} | "
            f"{_f(s['tok_per_s'], '.1f')} | {_steady(p)} | {_f(s['req_per_s'])} | "
            f"{_ms(s['ttft_p50_s'])} | "
            f"{_ms(s['ttft_p99_s'])} | {_ms(s['server_ttft_p50_s'])} | {_ms(s['itl_p50_s'])} | "
            f"{_ms(s['itl_p99_s'])} | "
            f"{_ms(s['tpot_p50_s'])} | {_f(s['e2e_p50_s'])} | {s['acceptance_rate']:.2f} | "
            f"{_f(s['mean_accepted_length'])} | {_delta(p['eager_steps'])} | "
            f"{_delta(p['steps'])} | {_delta(p.get('overlapped_steps'))} | "
            f"{_f(p.get('step_ms'), '.3f')} | "
            f"{_f(p.get('host_ms'), '.3f')} | {_f(p.get('gpu_ms'), '.3f')} | {_busy(p)} | "
            f"{s['errors']} |"
        )
    return "\n".join(lines) + "\n"


def drafting_table(passes: list[dict]) -> str:
    """Per pass: how many steps drafted, the drafter's exposed time (what those steps spent
    getting drafts before launching) as a share of all steps' time, the synchronous steps and
    their mean time from the end of the step before (against the step ms of the pass table:
    what running a step synchronously cost), and where a remote drafter's drafts came from
    (deferred: steps that went without the drafts asked as the step before committed, their
    reply not there within the patience; sent at launch: questions held back at a commit and
    sent once the next step launched, of which probes were sent only to time a launch's round
    trip; EMAs: the remote drafter's round trip of questions sent at the commit, drafting step,
    commit-to-launch gap, round trip of questions sent at the launch and launch-to-commit span,
    as its auto patience saw them at the pass's end)."""
    lines = [
        "| pass | drafting steps | exposed ms/drafting step | exposed share of step time | "
        "ask after the commit ms/sync step | "
        "sync steps | ms/sync step | look-ahead hits | branch hits | prefetched replies | "
        "deferred | late | failed | sent at launch (probes) | "
        "pipelined hypotheses held / failed | "
        "EMAs rtt / step / gap / launch rtt / launch-to-commit ms |",
        "|---" * 16 + "|",
    ]
    for p in passes:
        n, s, total = p.get("draft_steps"), p.get("draft_s"), p.get("step_s")
        asks, ask_s = p.get("ask_steps"), p.get("ask_s")  # (absent from older JSON)
        ask = _f(ask_s / asks * 1e3 if asks else None, ".3f")
        d = p.get("drafter") or {}
        ema = p.get("drafter_ema_ms") or {}
        emas = " / ".join(_f(v, ".2f") for v in ema.values())  # metrics.DRAFTER_TIMINGS' order
        emas = emas if any(v is not None for v in ema.values()) else "n/a"
        lines.append(
            f"| {p['name']} | {_delta(n)} | {_f(s / n * 1e3 if n else None, '.3f')} | "
            f"{f'{s / total:.1%}' if n and total else 'n/a'} | {ask} | "
            f"{_delta(p.get('sync_steps'))} | "
            f"{_f(p.get('sync_ms'), '.3f')} | {_delta(d.get('lookahead'))} | "
            f"{_delta(d.get('branched'))} | {_delta(d.get('prefetched'))} | "
            f"{_delta(d.get('deferred'))} | {_delta(d.get('late'))} | {_delta(d.get('failed'))} | "
            f"{_delta(d.get('at_launch'))} ({_delta(d.get('probes'))}) | "
            f"{_delta(d.get('hypotheses_held'))} / {_delta(d.get('hypotheses_failed'))} | {emas} |"
        )
    return "\n".join(lines) + "\n"


def kind_table(per_kind: dict[str, dict]) -> str:
    """Per prompt kind, over all first-sight timed passes of one configuration."""
    lines = [
        "| kind | reqs | tokens | acceptance | mean acc len | TTFT p50 ms | ITL p50 ms | "
        "TPOT p50 ms | E2E p50 s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, s in per_kind.items():
        lines.append(
            f"| {kind} | {s['requests']} | {s['completion_tokens']} | {s['acceptance_rate']:.2f} "
            f"| {_f(s['mean_accepted_length'])} | {_ms(s['ttft_p50_s'])} | "
            f"{_ms(s['itl_p50_s'])} | {_ms(s['tpot_p50_s'])} | {_f(s['e2e_p50_s'])} |"
        )
    return "\n".join(lines) + "\n"


def ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or not b else f"{a / b:.2f}×"


def config_markdown(rec: dict) -> str:
    m = rec["model"]
    timed = [p for p in rec["passes"] if p["timed"]]
    out = [
        f"### {rec['config']} (drafter={m['drafter']}, K={m['max_draft_len']}, "
        f"graphs={m['cuda_graphs']}, {m['device']}, {m['dtype']})\n\n",
        pass_table(timed),
    ]
    replay = next((p for p in timed if p["name"] == "replay"), None)
    first = next((p for p in timed if p["concurrency"] == (replay or {}).get("concurrency")), None)
    if replay and first:
        f, r = first["summary"], replay["summary"]
        out.append(
            f"first-sight ÷ replay at c={replay['concurrency']}: tok/s "
            f"{ratio(f['tok_per_s'], r['tok_per_s'])}, TTFT p50 "
            f"{ratio(f['ttft_p50_s'], r['ttft_p50_s'])}, TTFT p99 "
            f"{ratio(f['ttft_p99_s'], r['ttft_p99_s'])}, E2E p50 "
            f"{ratio(f['e2e_p50_s'], r['e2e_p50_s'])}\n"
        )
    solo = next((p for p in timed if p["concurrency"] == 1 and p["name"] != "replay"), None)
    if solo and m["drafter"] == "none" and solo.get("one_token_gpu_ms"):
        g = solo["one_token_gpu_ms"]
        bound = 1e3 / g
        out.append(
            f"c=1: {solo['summary']['tok_per_s']:.1f} tok/s = "
            f"{solo['summary']['tok_per_s'] / bound:.0%} of 1 / (1-token graph replay "
            f"{g:.3f} ms, weights only) = {bound:.0f} tok/s; step period {solo['step_ms']:.3f} "
            f"ms, so the host adds {solo['step_ms'] - g:.3f} ms a step on the critical path\n"
        )
    if solo and m["drafter"] == "none" and solo.get("gpu_ms"):
        g = solo["gpu_ms"]
        out.append(
            f"c=1: {solo['summary']['tok_per_s']:.1f} tok/s = "
            f"{solo['summary']['tok_per_s'] * g / 1e3:.0%} of 1 / (the served 1-token steps' "
            f"device time, {g:.3f} ms mean, measured while serving) = {1e3 / g:.0f} tok/s; "
            f"GPU busy {_busy(solo)} of the pass\n"
        )
    if m["drafter"] != "none" and any(
        p.get("draft_steps") or any((p.get("drafter") or {}).values()) for p in timed
    ):  # synchronous drafting steps, or a remote drafter's (pipelined ones have none of those)
        out.append("\n" + drafting_table(timed) + "\n")
    if any(p.get("policy") for p in timed):
        out.append("\nThe draft-length policy per pass:\n\n" + policy_table(timed) + "\n")
    out.append("\nPer prompt kind, pooled over the first-sight passes:\n\n")
    out.append(kind_table(rec["per_kind_first_sight"]))
    return "".join(out)


def summary_markdown(results: list[dict]) -> str:
    """tok/s (overall and steady) of each configuration at each pass, and their ratios to
    `none` in the same pass: the steady ratio is the one ramp-up and drain do not blur."""
    names = [r["config"] for r in results]
    others = [n for n in names if n != "none"]
    base = next((r for r in results if r["config"] == "none"), None)
    head = "| pass | " + " | ".join(
        [f"{n} tok/s" for n in names] + [f"{n} steady tok/s" for n in names]
    )
    if base:
        head += " | " + " | ".join(f"{n} ÷ none | {n} ÷ none, steady" for n in others)
    lines = [head + " |", "|---" * (head.count("|")) + "|"]
    for i, p in enumerate(results[0]["passes"]):
        if not p["timed"]:
            continue
        tps = [r["passes"][i]["summary"]["tok_per_s"] for r in results]
        steady = [r["passes"][i].get("steady_tok_s") for r in results]
        row = f"| {p['name']} | " + " | ".join([_f(t, ".1f") for t in tps + steady])
        if base:
            b = base["passes"][i]["summary"]["tok_per_s"]
            bs = base["passes"][i].get("steady_tok_s")
            row += " | " + " | ".join(
                f"{ratio(t, b)} | {ratio(st, bs)}"
                for n, t, st in zip(names, tps, steady, strict=True)
                if n != "none"
            )
        lines.append(row + " |")
    kinds = [k for k in ALL_KINDS if k in results[0]["per_kind_first_sight"]]
    lines += ["", "Mean accepted length (acceptance) per prompt kind, first-sight passes:", ""]
    lines += ["| kind | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for k in kinds:
        cells = []
        for r in results:
            s = r["per_kind_first_sight"].get(k)
            mal = s and s["mean_accepted_length"]
            cells.append("n/a" if not mal else f"{mal:.2f} ({s['acceptance_rate']:.2f})")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def repeat_ratios(results: list[dict], key: str = "tok_per_s") -> dict[str, dict[str, dict]]:
    """With `--repeat`: per configuration other than `none` and per timed pass, the ratio of
    its mean tok/s over the rounds to `none`'s, and the range of the per-round ratios (round r
    of a configuration against round r of `none`, servers started one after the other; only
    rounds where both ran). `key`: "tok_per_s" (overall) or "steady_tok_s". Also `none`'s own
    spread (max / min over rounds): the noise floor of a single ratio."""

    def tps(rec: dict, i: int) -> float | None:
        p = rec["passes"][i]
        return p["summary"]["tok_per_s"] if key == "tok_per_s" else p.get(key)

    rounds: dict[str, dict[int, dict]] = {}  # config -> round -> record
    for rec in results:
        by_round = rounds.setdefault(rec["config"], {})
        by_round[rec.get("round", len(by_round))] = rec
    base = rounds.get("none")
    if not base:
        return {}
    out: dict[str, dict[str, dict]] = {}
    first = results[0]["passes"]
    for name, recs in rounds.items():
        both = sorted(set(recs) & set(base))  # a round where either failed compares nothing
        for i, p in enumerate(first):
            if not p["timed"] or not both:
                continue
            mine = [tps(recs[r], i) for r in both]
            ref = [tps(base[r], i) for r in both]
            if any(v is None for v in mine + ref) or min(ref) <= 0:
                continue
            cell = out.setdefault(name, {})[p["name"]] = {
                "rounds": len(mine),
                "mean": sum(mine) / len(mine),
            }
            if name == "none":
                cell["spread"] = max(mine) / min(mine)
            else:
                pairs = [m / r for m, r in zip(mine, ref, strict=True)]
                cell["ratio_of_means"] = cell["mean"] / (sum(ref) / len(ref))
                cell["min"], cell["max"] = min(pairs), max(pairs)
    return out


def repeat_markdown(results: list[dict]) -> str:
    """The `--repeat` table: mean tok/s per configuration, ratio of means to `none`, the range
    of the per-round ratios, and `none`'s own spread, overall / steady."""
    overall, steady = repeat_ratios(results), repeat_ratios(results, "steady_tok_s")
    if "none" not in overall:
        return ""
    names = [n for n in overall if n != "none"]
    if not names:
        return ""
    head = "| pass | none mean tok/s | none max ÷ min | " + " | ".join(
        f"{n} mean tok/s | {n} ÷ none (range of rounds) | steady" for n in names
    )
    lines = [head + " |", "|---" * head.count("|") + "|"]
    for pname, b in overall["none"].items():
        row = f"| {pname} | {b['mean']:.1f} | {b['spread']:.2f} |"
        for n in names:
            c = overall[n].get(pname)
            st = steady.get(n, {}).get(pname)
            if c is None:
                row += " n/a | n/a | n/a |"
                continue
            row += (
                f" {c['mean']:.1f} | {c['ratio_of_means']:.2f}× ({c['min']:.2f}–{c['max']:.2f}) |"
                + (
                    f" {st['ratio_of_means']:.2f}× ({st['min']:.2f}–{st['max']:.2f}) |"
                    if st
                    else " n/a |"
                )
            )
        lines.append(row)
    rounds = overall["none"][next(iter(overall["none"]))]["rounds"]
    return f"Over {rounds} rounds (every configuration once per round, fresh servers):\n\n" + (
        "\n".join(lines) + "\n"
    )


# -- --paired: speculation on and off on the same server -------------------------------------
#
# A pair is two passes on one server, back to back, on the two halves of one fresh batch: one
# with speculation on, one with `speculation.disable` set on every request. Its ratio on / off
# is free of the server-to-server spread (fresh servers' `none` varied 1.13x at c=64 on the
# H200, round 14); what is left is the pass-to-pass spread within one server, and drift, which
# alternating the order cancels over an even number of pairs. On a `none` server both halves
# decode plainly: its on / off is an A/A test, the noise floor of a paired ratio.


def _tok_s(p: dict, key: str) -> float | None:
    return p["summary"]["tok_per_s"] if key == "tok_per_s" else p.get(key)


def _spread(values: list[float]) -> dict:
    """n, mean, min, max and the sample standard deviation (None for one value)."""
    return dict(
        n=len(values),
        mean=statistics.fmean(values),
        min=min(values),
        max=max(values),
        sd=statistics.stdev(values) if len(values) > 1 else None,
    )


def paired_ratios(passes: list[dict], key: str = "tok_per_s") -> dict[int, dict]:
    """One server's paired passes (in the order they ran), per concurrency: each pair's ratio
    on / off of `key` ("tok_per_s" or "steady_tok_s") and their spread (`_spread`), the mean
    ratio of the pairs that ran "on" first and of those that ran "off" first (a gap between
    the two is drift within a pair, or one half's passes changing the server for the other),
    the ratio of the halves' mean tok/s, and what each half drafted: tokens from the requests'
    own stats and, with --metrics, drafting steps (an "off" half must have none), and the
    tokens each half generated (`tokens_on` / `tokens_off`: halves are different prompts, and
    in a pass short enough for its ramp-up and drain to weigh, the half with fewer tokens
    reads slower whatever it runs). A pair missing a half or a figure is counted in
    `skipped`."""
    pairs: dict[tuple[int, int], dict] = {}
    for p in passes:
        if p.get("pair") is None or not p.get("timed", True):
            continue
        slot = pairs.setdefault((p["concurrency"], p["pair"]), {})
        side = "on" if p["speculate"] else "off"
        slot.setdefault("first", side)
        slot[side] = p
    out: dict[int, dict] = {}
    for (c, _pair), slot in sorted(pairs.items()):
        cell = out.setdefault(c, dict(skipped=0, on_first=[], off_first=[], on=[], off=[]))
        for side in ("on", "off"):
            if side in slot:
                summary = slot[side]["summary"]
                cell[f"drafted_{side}"] = cell.get(f"drafted_{side}", 0) + summary["drafted"]
                done = summary.get("completion_tokens") or 0
                cell[f"tokens_{side}"] = cell.get(f"tokens_{side}", 0) + done
                steps = slot[side].get("draft_steps")
                if steps is not None:
                    cell[f"draft_steps_{side}"] = cell.get(f"draft_steps_{side}", 0) + steps
        on, off = (_tok_s(slot[s], key) if s in slot else None for s in ("on", "off"))
        if on is None or not off:
            cell["skipped"] += 1
            continue
        cell["on"].append(on)
        cell["off"].append(off)
        cell[f"{slot['first']}_first"].append(on / off)
    for cell in out.values():
        ratios = [a / b for a, b in zip(cell["on"], cell["off"], strict=True)]
        cell["ratios"] = ratios
        if ratios:
            cell.update(_spread(ratios))
            cell["ratio_of_means"] = statistics.fmean(cell["on"]) / statistics.fmean(cell["off"])
        for order in ("on_first", "off_first"):
            cell[f"{order}_mean"] = statistics.fmean(cell[order]) if cell[order] else None
    return out


def fresh_ratios(results: list[dict], key: str = "tok_per_s") -> dict[tuple[str, int], dict]:
    """--paired, across servers: for each server (config, round) other than `none`, per
    concurrency, its "on" passes' mean tok/s / `none`'s (the server of the same round) over the
    same passes, matched by name (the same prompts), and the same for its "off" passes: the
    fresh-server ratio config / none of the unpaired mode, and what a drafter server costs a
    request that does not speculate."""
    base = {r.get("round", 0): r for r in results if r["config"] == "none"}
    out: dict[tuple[str, int], dict] = {}
    for rec in results:
        rnd = rec.get("round", 0)
        if rec["config"] == "none" or rnd not in base:
            continue
        theirs = {p["name"]: p for p in base[rnd]["passes"]}
        cells: dict[int, dict[str, list[tuple[float, float]]]] = {}
        for p in rec["passes"]:
            q = theirs.get(p["name"])
            if p.get("pair") is None or q is None:
                continue
            mine, ref = _tok_s(p, key), _tok_s(q, key)
            if mine is not None and ref:
                side = "on" if p["speculate"] else "off"
                cells.setdefault(p["concurrency"], {}).setdefault(side, []).append((mine, ref))
        out[(rec["config"], rnd)] = {
            c: {side: sum(m for m, _ in v) / sum(r for _, r in v) for side, v in sides.items()}
            for c, sides in cells.items()
        }
    return out


def _x(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.3f}×"


def _range(cell: dict | None) -> str:
    if not cell or not cell.get("n"):
        return "n/a"
    if cell["n"] == 1:
        return f"{cell['mean']:.3f}×"
    return f"{cell['mean']:.3f}× ({cell['min']:.3f}–{cell['max']:.3f})"


def paired_markdown(results: list[dict]) -> str:
    """The --paired tables: per server and concurrency, the paired ratio on / off (mean over
    the pairs, their range; by which half ran first; steady), next to the fresh-server ratios
    on / none and off / none; then, per configuration, every server's pairs pooled."""
    fresh = fresh_ratios(results)
    lines = [
        "Paired, same server: speculation on ÷ off per request (`speculation.disable`), back "
        "to back on halves of one fresh batch. On a `none` server both halves decode plainly "
        "(an A/A test: the noise floor).",
        "",
        "| server | c | pairs | on tok/s | off tok/s | on ÷ off (range of pairs) | on first / "
        "off first | on ÷ off, steady | on ÷ none (fresh servers) | off ÷ none | drafted "
        "tokens on / off | drafting steps on / off | tokens on ÷ off |",
        "|---" * 13 + "|",
    ]
    pooled: dict[str, dict[int, dict[str, list]]] = {}
    for rec in results:
        rnd = rec.get("round", 0)
        overall = paired_ratios(rec["passes"])
        steady = paired_ratios(rec["passes"], "steady_tok_s")
        for c, cell in overall.items():
            f = fresh.get((rec["config"], rnd), {}).get(c, {})
            pool = pooled.setdefault(rec["config"], {}).setdefault(
                c, dict(ratios=[], servers=[], fresh=[])
            )
            pool["ratios"] += cell["ratios"]
            if cell["ratios"]:
                pool["servers"].append(cell["mean"])
            if "on" in f:
                pool["fresh"].append(f["on"])
            orders = " / ".join(_x(cell[o]) for o in ("on_first_mean", "off_first_mean"))
            steps = " / ".join(_delta(cell.get(f"draft_steps_{s}")) for s in ("on", "off"))
            lines.append(
                f"| {rec['config']} r{rnd} | {c} | {len(cell['ratios'])} | "
                f"{_f(statistics.fmean(cell['on']) if cell['on'] else None, '.1f')} | "
                f"{_f(statistics.fmean(cell['off']) if cell['off'] else None, '.1f')} | "
                f"{_range(cell)} | {orders} | {_range(steady.get(c))} | "
                f"{_x(f.get('on'))} | {_x(f.get('off'))} | "
                f"{cell.get('drafted_on', 0)} / {cell.get('drafted_off', 0)} | {steps} | "
                f"{ratio(cell.get('tokens_on'), cell.get('tokens_off'))} |"
            )
    lines += [
        "",
        "Pooled per configuration (every pair of every server; the servers' mean paired "
        "ratios; the fresh-server ratio on ÷ none per round):",
        "",
        "| config | c | servers | pairs | on ÷ off (range of pairs) | sd | servers' means | "
        "on ÷ none (range of rounds) |",
        "|---" * 8 + "|",
    ]
    for config, levels in pooled.items():
        for c, pool in levels.items():
            pairs = _spread(pool["ratios"]) if pool["ratios"] else None
            servers, rounds = pool["servers"], pool["fresh"]
            lines.append(
                f"| {config} | {c} | {len(servers)} | {len(pool['ratios'])} | {_range(pairs)} | "
                f"{_f(pairs and pairs['sd'], '.3f')} | "
                + (f"{min(servers):.3f}–{max(servers):.3f}" if servers else "n/a")
                + f" | {_range(_spread(rounds) if rounds else None)} |"
            )
    return "\n".join(lines) + "\n"
