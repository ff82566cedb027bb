"""The draft-length policy's side of a serving pass (`specwire_draft_policy_*` metrics,
docs/architecture.md "Metrics"): how many steps it ran in each mode, which draft lengths it
chose, and what it had learnt by the pass's end (each mode's rate per load, the host and
exposed times of its cost table, the population's acceptance). It says why a server did or
did not speculate at a load."""

from __future__ import annotations

import re

PREFIX = "specwire_draft_policy_"
_LABELLED = re.compile(r"^specwire_draft_policy_(\w+)\{(.*)\}$")


def labelled_samples(name: str, labels: dict[str, str], value: float, out: dict) -> None:
    """Keep a policy sample under its labels too (`servers.scrape_metrics` sums the others)."""
    if name.startswith(PREFIX):
        key = ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "model")
        out[f"{name}{{{key}}}"] = value


def _parse(samples: dict[str, float]) -> dict[str, dict[str, float]]:
    """{family tail: {label value: sample value}} of the labelled policy samples (each policy
    family but the rate has one label besides the model; the rate's key is "mode@rows")."""
    out: dict[str, dict[str, float]] = {}
    for key, value in samples.items():
        m = _LABELLED.match(key)
        if m:
            labels = dict(p.split("=", 1) for p in m.group(2).split(",") if p)
            label = "@".join(labels[k] for k in ("mode", "rows") if k in labels)
            if m.group(1) != "rate" or not label:
                label = ",".join(labels.values())
            out.setdefault(m.group(1), {})[label] = value
    return out


def policy_pass(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """The pass's policy record: counters as deltas, learnt values at the pass's end; None
    when the target exported none (an older target, or metrics off)."""
    b, a = _parse(before), _parse(after)
    if "steps_total" not in a:
        return None

    def delta(tail: str) -> dict[str, float]:
        return {k: v - b.get(tail, {}).get(k, 0.0) for k, v in a.get(tail, {}).items()}

    def ms(tail: str) -> dict[str, float]:
        return {k: v * 1e3 for k, v in a.get(tail, {}).items()}

    acc = a.get("acceptance", {})
    return dict(
        steps=delta("steps_total"),
        k_steps={int(k): v for k, v in delta("draft_len_steps_total").items()},
        rates=dict(a.get("rate", {})),
        host_ms=ms("host_seconds"),
        exposed_ms=ms("exposed_seconds"),
        accept=acc.get("a"),
        has_draft=acc.get("p"),
        # past the first draft: acceptance of draft m once the drafts before it were accepted
        deeper=[acc[f"d{m}"] for m in range(1, len(acc) + 1) if f"d{m}" in acc],
        # --pipeline-choice measured: the speculative windows' steps by variant, and each
        # variant's rate by the clock per load ("rows,variant")
        pipelining_steps=delta("pipelining_steps_total"),
        pipelining_rates=dict(a.get("pipelining_rate", {})),
    )


def _buckets(d: dict[str, float], fmt: str = ".2f") -> str:
    items = sorted(d.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0)
    return ", ".join(f"{k}: {v:{fmt}}" for k, v in items) or "n/a"


def policy_table(passes: list[dict]) -> str:
    """Per pass: steps in each mode, the share of steps that chose k > 0 and their mean k,
    each mode's measured rate (tokens/s per row) per rows bucket, and the cost table's host
    time of a synchronous step and exposed host time of an overlapped one per rows bucket."""
    lines = [
        "| pass | steps spec / plain | steps with k > 0 | mean k (k > 0) | rate spec / plain "
        "tok/s/row by rows | host ms of a sync step by rows | exposed ms of a plain step "
        "by rows | acceptance a / p |",
        "|---" * 8 + "|",
    ]
    for p in passes:
        pol = p.get("policy")
        if not pol:
            continue
        ks = {int(k): v for k, v in pol["k_steps"].items()}
        total = sum(ks.values())
        drafted = sum(v for k, v in ks.items() if k > 0)
        mean_k = sum(k * v for k, v in ks.items() if k > 0) / drafted if drafted else None
        loads = sorted({int(k.split("@")[1]) for k in pol["rates"]})
        rates = ", ".join(
            f"{n}: {_r(pol['rates'].get(f'spec@{n}'))} / {_r(pol['rates'].get(f'plain@{n}'))}"
            for n in loads
        )
        variants = pol.get("pipelining_steps") or {}
        split = (
            f" (pipelined {variants.get('pipelined', 0):.0f} / synchronous "
            f"{variants.get('synchronous', 0):.0f})"
            if variants
            else ""
        )
        lines.append(
            f"| {p['name']} | {pol['steps'].get('spec', 0):.0f} / "
            f"{pol['steps'].get('plain', 0):.0f}{split} | "
            f"{f'{drafted / total:.0%}' if total else 'n/a'} | "
            f"{f'{mean_k:.1f}' if mean_k is not None else 'n/a'} | {rates or 'n/a'} | "
            f"{_buckets(pol['host_ms'], '.3f')} | {_buckets(pol['exposed_ms'], '.3f')} | "
            f"{_r(pol['accept'], '.2f')} / {_r(pol['has_draft'], '.2f')} |"
        )
    return "\n".join(lines) + "\n"


def _r(x: float | None, fmt: str = ".0f") -> str:
    return "n/a" if x is None else f"{x:{fmt}}"
