"""The paged KV cache gives the same logits however a sequence's tokens are split into steps,
batched with other sequences, laid out (ragged or uniform) or placed in blocks."""

from __future__ import annotations

import pytest
import torch
from paged_runner import PagedRunner

from specwire.common.model.loader import LoadedModel

TOL = 1e-4  # fp32 on the CPU
TEXT = "Speculative decoding: a drafter proposes, the target verifies. Blocks of sixteen tokens!"
OTHER = ["Once upon a time, far away,", "The sea, the sky and the stars."]


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    diff = (got - want).abs().max().item()
    assert diff <= TOL, f"max abs diff {diff:.2e}"


@pytest.fixture(scope="module")
def ids(tiny: LoadedModel) -> list[int]:
    ids = tiny.tokenizer.encode(TEXT)
    assert len(ids) > 3 * tiny.model.block_size, "the prompt should span several blocks"
    return ids


@pytest.fixture(scope="module")
def whole(tiny: LoadedModel, ids: list[int]) -> torch.Tensor:
    return PagedRunner(tiny.model).step([(0, ids)])[0]  # [T, V]


def test_block_tables_are_shuffled(tiny: LoadedModel, ids: list[int]) -> None:
    runner = PagedRunner(tiny.model)
    runner.step([(0, ids)])
    table = runner.tables[0]
    assert table != sorted(table) and len(table) > 2  # otherwise the tests below prove less


def test_chunked_prefill_matches_whole_prompt(tiny: LoadedModel, ids, whole) -> None:
    runner = PagedRunner(tiny.model)
    chunks, start = [], 0
    for size in (5, 11, 16, 1, 9):  # crosses block boundaries mid-chunk
        chunks.append(runner.step([(0, ids[start : start + size])])[0])
        start += size
    chunks.append(runner.step([(0, ids[start:])])[0])
    assert_close(torch.cat(chunks), whole)


def test_token_by_token_matches_whole_prompt(tiny: LoadedModel, ids, whole) -> None:
    runner = PagedRunner(tiny.model)
    rows = [runner.step([(0, [t])])[0] for t in ids]
    assert_close(torch.cat(rows), whole)


def test_contiguous_and_shuffled_blocks_agree(tiny: LoadedModel, ids, whole) -> None:
    contiguous = PagedRunner(tiny.model, shuffle_seed=None)
    assert_close(contiguous.step([(0, ids)])[0], whole)
    other_order = PagedRunner(tiny.model, shuffle_seed=7)
    assert_close(other_order.step([(0, ids)])[0], whole)


def test_prefill_chunk_batched_with_decode_rows(tiny: LoadedModel, ids, whole) -> None:
    """A ragged step mixing one sequence's prefill chunk with decode rows of two others gives
    each row what it gets when run alone."""
    tok = tiny.tokenizer
    others = [tok.encode(t) for t in OTHER]
    runner = PagedRunner(tiny.model)
    runner.step([(1, others[0][:-1]), (2, others[1][:-1])])  # the others' prompts, minus one
    a0, a1, a2 = runner.step([(0, ids[:20]), (1, others[0][-1:]), (2, others[1][-1:])])
    b1, b0, b2 = runner.step([(1, [7]), (0, ids[20:]), (2, [9])])  # next decode, rest of prompt
    assert_close(torch.cat([a0, b0]), whole)
    for prompt, extra, first, second in ((others[0], 7, a1, b1), (others[1], 9, a2, b2)):
        alone = PagedRunner(tiny.model, shuffle_seed=5).step([(0, prompt + [extra])])[0]
        assert_close(first, alone[-2:-1])
        assert_close(second, alone[-1:])


@pytest.mark.parametrize("q", [1, 3])
def test_uniform_layout_matches_ragged(tiny: LoadedModel, q: int) -> None:
    """Rows of q tokens each (decode, verify) after different context lengths: the uniform
    layout, with padding rows on the dummy block, gives the ragged layout's logits."""
    tok = tiny.tokenizer
    prompts = [tok.encode(t) for t in (TEXT, *OTHER)]
    new = [[11 + i + j for j in range(q)] for i in range(len(prompts))]
    ragged, uniform = PagedRunner(tiny.model), PagedRunner(tiny.model, shuffle_seed=3)
    for runner in (ragged, uniform):
        runner.step([(i, p) for i, p in enumerate(prompts)])
    want = ragged.step([(i, t) for i, t in enumerate(new)])
    got = uniform.step_uniform([(i, t) for i, t in enumerate(new)], pad_rows=2)
    assert len(got) == len(prompts)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w)


def test_decode_rows_see_their_own_history(tiny: LoadedModel, ids) -> None:
    """Two sequences with the same last token but different histories get different logits
    (the cache is read per sequence, not shared by accident)."""
    runner = PagedRunner(tiny.model)
    runner.step([(0, ids[:10]), (1, ids[10:30])])
    a, b = runner.step([(0, [42]), (1, [42])])
    assert (a - b).abs().max().item() > 1e-2


@pytest.mark.slow
def test_smollm2_chunked_prefill_matches_whole_prompt(smollm2: LoadedModel) -> None:
    ids = smollm2.tokenizer.encode(" ".join([TEXT, *OTHER, TEXT]))
    assert len(ids) > 40
    whole = PagedRunner(smollm2.model).step([(0, ids)])[0]
    runner = PagedRunner(smollm2.model)
    parts = [runner.step([(0, ids[:13])])[0], runner.step([(0, ids[13:30])])[0]]
    parts += [runner.step([(0, [t])])[0] for t in ids[30:33]]
    parts.append(runner.step([(0, ids[33:])])[0])
    assert_close(torch.cat(parts), whole)
