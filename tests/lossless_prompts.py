"""Fifty varied prompts for losslessness checks: code, prose, lists, repetition, unicode."""

from __future__ import annotations

import random

_FIXED = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "Once upon a time there was a little model that wanted to",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "a b c d e f g a b c d e f g a b c",
    "SELECT name, email FROM users WHERE id = 1; SELECT name, email FROM",
    "Héllo wörld — ünïcödé tëxt 日本語のテキスト and emoji 🙂🙂",
    '<html><body><div class="a"><div class="a"><div class=',
    "Q: What is the capital of France?\nA: Paris.\nQ: What is the capital of Spain?\nA:",
    "import numpy as np\nimport torch\nimport",
    "Summarise: speculative decoding lets a small drafter propose tokens.",
    "x",
    "the the the the the the the",
    "class Stack:\n    def push(self, item):\n        self.items.append(item)\n    def pop(self):",
]

_WORDS = (
    "model token cache block draft verify accept reject step batch graph kernel memory sea sky "
    "star story write read fast slow small large target drafter return value list dict"
).split()


def lossless_prompts(n: int = 50, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = list(_FIXED)
    while len(out) < n:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 30))]
        if rng.random() < 0.4:  # repeated phrases give n-gram drafters something to find
            words = words[: rng.randint(2, 6)] * rng.randint(2, 5)
        out.append(" ".join(words))
    return out[:n]
