"""Session drafters (specwire/common/drafting.py) that both services run: `ngram`, `model:NAME` and
user plugins (`module:Class`). Each service turns its flags into these calls."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specwire.common.drafters.ngram import NGramDrafter
from specwire.common.drafters.plugin import load_plugin
from specwire.common.drafting import SessionDrafter

if TYPE_CHECKING:
    import torch

__all__ = ["NGramDrafter", "SessionDrafter", "load_model_drafter", "load_plugin"]


def load_model_drafter(
    name: str,
    *,
    device: str,
    dtype: torch.dtype,
    num_blocks: int,
    probs_top_n: int = 0,
    seed: int = 0,
    block_size: int = 16,
    max_positions: int | None = None,
    progress: bool = False,
) -> SessionDrafter:
    """`model:NAME`: load the draft model (any `--model` name) and draft greedily with it from a
    KV block pool of its own (`num_blocks` blocks for all sessions together)."""
    from specwire.common.drafters.model import ModelDrafter  # (imported late: it pulls in torch)
    from specwire.common.model import loader

    loaded = loader.load_model(
        name,
        device=device,
        dtype=dtype,
        block_size=block_size,
        max_positions=max_positions,
        progress=progress,
    )
    return ModelDrafter(
        loaded.model,
        name=f"model:{loaded.name}",
        vocab_size=int(loaded.config.vocab_size),
        tokenizer_fingerprint=loaded.tokenizer.fingerprint,
        num_blocks=num_blocks,
        probs_top_n=probs_top_n,
        seed=seed,
    )
