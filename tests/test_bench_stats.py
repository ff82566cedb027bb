"""The serving benchmark's steady-state figure (bench/serving_stats.py): the window between
"all c requests stream" and "the last prompt was sent", on synthetic request records."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from serving_stats import RequestRecord, steady_state  # noqa: E402


def _record(sent: float, first: float, every: float, tokens: int, done: bool = True):
    rec = RequestRecord("p", "edit", sent=sent)
    rec.chunks = [(first + i * every, 1) for i in range(tokens)]
    rec.done = rec.chunks[-1][0] if done else None
    return rec


def test_the_window_excludes_ramp_up_and_drain() -> None:
    # c=2: requests start at 0.0 and 0.5 (first tokens 0.1 and 0.6), a third is sent at 1.5.
    # Window [0.6, 1.5]: every chunk in it counts, whichever request it belongs to.
    recs = [_record(0.0, 0.1, 0.01, 150), _record(0.5, 0.6, 0.01, 200), _record(1.5, 1.6, 0.01, 50)]
    got = steady_state(recs, concurrency=2)
    inside = sum(1 for r in recs for t, _ in r.chunks if 0.6 <= t <= 1.5)
    assert got["steady_s"] == pytest.approx(0.9)
    assert got["steady_chunks"] == inside
    assert got["steady_tok_s"] == pytest.approx(inside / 0.9)
    assert got["steady_na"] is None


def test_too_short_a_window_or_too_few_streams_is_not_a_figure() -> None:
    short = steady_state([_record(0.0, 0.1, 0.01, 30), _record(0.15, 0.2, 0.01, 30)], 1)
    assert short["steady_tok_s"] is None and "window" in short["steady_na"]
    alone = steady_state([_record(0.0, 0.1, 0.01, 30)], 2)
    assert alone["steady_tok_s"] is None and "only 1 of c=2" in alone["steady_na"]


def test_failed_requests_add_no_tokens() -> None:
    recs = [_record(0.0, 0.1, 0.01, 150), _record(0.5, 0.6, 0.01, 200, done=False)]
    recs.append(_record(1.5, 1.6, 0.01, 50))
    got = steady_state(recs, concurrency=2)
    ok_inside = sum(1 for r in recs if r.ok for t, _ in r.chunks if 0.6 <= t <= 1.5)
    assert (
        got["steady_chunks"]
        == ok_inside
        < sum(1 for r in recs for t, _ in r.chunks if 0.6 <= t <= 1.5)
    )


def _config(name: str, tok_s: list[float], steady: list[float | None], rnd: int = 0) -> dict:
    passes = [{"name": "warm-up", "timed": False, "summary": {"tok_per_s": 1.0}}]
    passes += [
        {"name": f"c={i}", "timed": True, "summary": {"tok_per_s": t}, "steady_tok_s": st}
        for i, (t, st) in enumerate(zip(tok_s, steady, strict=True))
    ]
    return {"config": name, "passes": passes, "round": rnd}


def test_repeated_rounds_give_mean_ratios_and_their_range() -> None:
    from serving_stats import repeat_markdown, repeat_ratios

    results = [  # round 0, then round 1
        _config("none", [100.0, 200.0], [110.0, None], 0),
        _config("ngram", [150.0, 180.0], [160.0, None], 0),
        _config("none", [120.0, 220.0], [130.0, None], 1),
        _config("ngram", [132.0, 231.0], [140.0, None], 1),
    ]
    got = repeat_ratios(results)
    assert got["none"]["c=0"]["spread"] == pytest.approx(1.2)
    cell = got["ngram"]["c=1"]
    assert cell["rounds"] == 2 and cell["mean"] == pytest.approx(205.5)
    assert cell["ratio_of_means"] == pytest.approx(205.5 / 210.0)
    assert (cell["min"], cell["max"]) == (pytest.approx(0.9), pytest.approx(1.05))
    steady = repeat_ratios(results, "steady_tok_s")
    assert steady["ngram"]["c=0"]["ratio_of_means"] == pytest.approx(150.0 / 120.0)
    assert "c=1" not in steady["ngram"]  # no steady figure: no ratio
    table = repeat_markdown(results)
    assert "Over 2 rounds" in table
    assert "| c=1 | 210.0 | 1.10 | 205.5 | 0.98× (0.90–1.05) | n/a |" in table


def test_without_none_there_is_nothing_to_compare() -> None:
    from serving_stats import repeat_markdown, repeat_ratios

    results = [_config("ngram", [1.0], [1.0]), _config("ngram", [2.0], [2.0])]
    assert repeat_ratios(results) == {} and repeat_markdown(results) == ""


def test_rounds_pair_by_number_when_a_round_failed() -> None:
    """ngram failed in round 0: its round 1 is compared with none's round 1 only."""
    from serving_stats import repeat_ratios

    results = [
        _config("none", [100.0], [100.0], 0),
        _config("none", [200.0], [200.0], 1),
        _config("ngram", [210.0], [210.0], 1),
    ]
    cell = repeat_ratios(results)["ngram"]["c=0"]
    assert cell["rounds"] == 1 and cell["ratio_of_means"] == pytest.approx(1.05)
    assert (cell["min"], cell["max"]) == (pytest.approx(1.05), pytest.approx(1.05))


def test_every_other_round_runs_the_configurations_in_reverse() -> None:
    """A configuration's position in the order must not favour it (round 11 on the H200: the
    same code 1.09x none at c=64 when run before none, 1.02x after): odd rounds reverse."""
    from serving import round_order

    configs = ["none", "ngram", "remote-ngram"]
    assert [round_order(configs, r) for r in range(3)] == [configs, configs[::-1], configs]
    assert round_order(configs, 1, fixed=True) == configs


def test_client_processes_share_every_prompt_once_and_the_concurrency() -> None:
    """--client-procs: each prompt goes to exactly one process, the processes' concurrency adds
    up to the pass's, and no process is started without a prompt or a request in flight."""
    from client_procs import shares

    out = shares(10, 8, 3)
    assert sorted(i for idx, _c in out for i in idx) == list(range(10))
    assert [c for _idx, c in out] == [3, 3, 2]
    assert shares(2, 1, 4) == [([0, 1], 1)]
    assert shares(1, 8, 4) == [([0], 2)]


def _paired(
    c: int, pair: int, on: bool, tok_s: float | None, drafted: int = 0, tokens: int = 0, **extra
) -> dict:
    name = f"c={c} {'on' if on else 'off'} #{pair}"
    summary = {"tok_per_s": tok_s, "drafted": drafted, "completion_tokens": tokens}
    return {"name": name, "concurrency": c, "timed": True, "pair": pair, "speculate": on,
            "summary": summary, **extra}  # fmt: skip


def test_paired_ratios_per_pair_with_their_spread_and_both_orders() -> None:
    """--paired: each pair's on / off, their mean, range and sd, and the mean of the pairs
    run on first apart from those run off first; the off halves' drafts are counted."""
    from serving_stats import paired_ratios

    passes = [
        {"name": "warm-up on", "concurrency": 2, "timed": False, "summary": {"tok_per_s": 1.0}},
        _paired(8, 0, True, 120.0, drafted=50, tokens=900, draft_steps=10.0),  # on first: 1.2
        _paired(8, 0, False, 100.0, tokens=1000, draft_steps=0.0),
        _paired(8, 1, False, 100.0, tokens=1100, draft_steps=0.0),  # off first: 0.9
        _paired(8, 1, True, 90.0, drafted=30, tokens=1000, draft_steps=7.0),
        _paired(64, 0, True, 300.0),
        _paired(64, 0, False, None),  # no figure: skipped
    ]
    got = paired_ratios(passes)
    cell = got[8]
    assert cell["ratios"] == [pytest.approx(1.2), pytest.approx(0.9)]
    assert cell["n"] == 2 and cell["mean"] == pytest.approx(1.05)
    assert (cell["min"], cell["max"]) == (pytest.approx(0.9), pytest.approx(1.2))
    assert cell["sd"] == pytest.approx(0.3 / 2**0.5)
    assert cell["on_first_mean"] == pytest.approx(1.2)
    assert cell["off_first_mean"] == pytest.approx(0.9)
    assert cell["ratio_of_means"] == pytest.approx(105.0 / 100.0)
    assert (cell["drafted_on"], cell["drafted_off"]) == (80, 0)
    assert (cell["draft_steps_on"], cell["draft_steps_off"]) == (17.0, 0.0)
    assert (cell["tokens_on"], cell["tokens_off"]) == (1900, 2100)
    assert got[64]["skipped"] == 1 and got[64]["ratios"] == [] and "mean" not in got[64]
    steady = paired_ratios(
        [
            _paired(8, 0, True, 1.0, steady_tok_s=110.0),
            _paired(8, 0, False, 1.0, steady_tok_s=88.0),
        ],
        "steady_tok_s",
    )
    assert steady[8]["mean"] == pytest.approx(1.25) and steady[8]["sd"] is None


def test_fresh_server_ratios_match_passes_by_name_within_a_round() -> None:
    """on / none and off / none: the drafter server's halves against the `none` server of the
    same round on the same prompts (pass names), whatever order each server ran them in."""
    from serving_stats import fresh_ratios, paired_markdown

    def server(config: str, rnd: int, on: list[float], off: list[float]) -> dict:
        passes = [_paired(8, p, True, t, tokens=950) for p, t in enumerate(on)]
        passes += [_paired(8, p, False, t, tokens=1000) for p, t in enumerate(off)]
        return {"config": config, "round": rnd, "passes": passes[::-1] if rnd else passes}

    results = [
        server("none", 0, [100.0, 110.0], [105.0, 95.0]),
        server("ngram", 0, [105.0, 126.0], [100.0, 100.0]),
        server("none", 1, [200.0, 200.0], [200.0, 200.0]),
        server("ngram", 1, [190.0, 190.0], [210.0, 210.0]),
    ]
    got = fresh_ratios(results)
    assert set(got) == {("ngram", 0), ("ngram", 1)}
    assert got[("ngram", 0)][8]["on"] == pytest.approx(231.0 / 210.0)
    assert got[("ngram", 0)][8]["off"] == pytest.approx(200.0 / 200.0)
    assert got[("ngram", 1)][8] == {"on": pytest.approx(0.95), "off": pytest.approx(1.05)}
    table = paired_markdown(results)
    # ngram round 0: pairs 1.05 and 1.26 (on first in both: listed first)
    assert "| ngram r0 | 8 | 2 | 115.5 | 100.0 | 1.155× (1.050–1.260) |" in table
    assert "| 1.100× | 1.000× | 0 / 0 |" in table
    assert table.splitlines()[4].endswith("| 0.95× |")  # every server: 1900 / 2000 tokens
    # pooled: four pairs (1.05, 1.26, 0.905, 0.905), servers' means 1.155 and 0.905, rounds
    # on / none 1.1 and 0.95
    assert "| ngram | 8 | 2 | 4 | 1.030× (0.905–1.260) |" in table
    assert "| 0.905–1.155 | 1.025× (0.950–1.100) |" in table


def test_paired_plan_splits_fresh_batches_evenly_and_alternates_the_order() -> None:
    """Every pass of a server is on prompts it has not seen, the on and off halves of a pair
    have the same size and mix of kinds (the pool cycles through the kinds, so an even/odd
    split would not), the first of a pair alternates (on/off, off/on) and flips by round."""
    from collections import Counter

    from prompt_pool import KINDS, Prompt
    from serving_plan import Ledger, plan_paired, split_by_kind

    pool = [Prompt(f"p{i}", KINDS[i % 4], f"text {i}") for i in range(120)]
    a, b = split_by_kind(tuple(pool[:16]))
    assert len(a) == len(b) == 8 and set(a).isdisjoint(b)
    assert Counter(p.kind for p in a) == Counter(p.kind for p in b) == dict.fromkeys(KINDS, 2)
    assert [int(p.id[1:]) for p in a] == sorted(int(p.id[1:]) for p in a)  # pool order kept

    plans = plan_paired(pool, [1, 4], None, 4, least=6, factor=2, pairs=2, rnd=0)
    assert [p.name for p in plans] == [
        "warm-up on", "warm-up off",
        "c=1 on #0", "c=1 off #0", "c=1 off #1", "c=1 on #1",
        "c=4 off #0", "c=4 on #0", "c=4 on #1", "c=4 off #1",
    ]  # fmt: skip
    assert [p.speculate for p in plans[:2]] == [True, False] and not plans[0].timed
    assert [len(p.prompts) for p in plans[2:]] == [6] * 4 + [8] * 4
    ledger = Ledger()
    for p in plans:
        ledger.admit(p.prompts, p.replay)  # raises on a repeated prompt
    assert len(ledger.sent) == 4 + 2 * 2 * (6 + 8)
    again = plan_paired(pool, [1, 4], None, 4, least=6, factor=2, pairs=2, rnd=1)
    assert [p.name for p in again][2:6] == ["c=1 off #0", "c=1 on #0", "c=1 on #1", "c=1 off #1"]
    assert {p.name: p.prompts for p in again} == {p.name: p.prompts for p in plans}
    with pytest.raises(SystemExit, match="needs 144 unique prompts"):
        plan_paired(pool, [1, 4], None, 4, least=6, factor=2, pairs=5)


def test_per_kind_paired_ratios_pool_each_sides_requests_by_kind() -> None:
    """`per_kind.py --paired`: per kind, on tok/s and off tok/s over the paired passes of one
    concurrency (tokens / end-to-end seconds, failed requests left out); other levels and
    unpaired passes are not counted."""
    from per_kind import paired_per_kind

    def req(kind, tokens, seconds, error=None):
        return {"kind": kind, "tokens": tokens, "e2e_s": seconds, "error": error}

    def pas(name, pair, on, requests):
        c = int(name.split()[0][2:]) if name.startswith("c=") else 8
        return {"name": name, "concurrency": c, "pair": pair, "speculate": on, "requests": requests}

    rounds = [
        {
            "passes": [
                pas("warm-up on", None, None, [req("edit", 999, 1.0)]),
                pas("c=1 on #0", 0, True, [req("edit", 30, 1.0), req("explain", 10, 1.0)]),
                pas("c=1 off #0", 0, False, [req("edit", 10, 1.0), req("explain", 10, 1.0)]),
                pas("c=1 on #1", 1, True, [req("edit", 10, 1.0), req("edit", 5, 0.1, "boom")]),
                pas("c=1 off #1", 1, False, [req("edit", 10, 1.0), req("tests", 10, 1.0)]),
                pas("c=8 on #0", 0, True, [req("edit", 500, 1.0)]),
                pas("c=8 off #0", 0, False, [req("edit", 1, 1.0)]),
            ]
        }
    ]
    assert paired_per_kind(rounds, 1) == {"edit": (20.0, 10.0), "explain": (10.0, 10.0)}
    assert paired_per_kind(rounds, 8) == {"edit": (500.0, 1.0)}
    assert paired_per_kind(rounds, 32) == {}
