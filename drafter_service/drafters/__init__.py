"""Drafters the service can run: `ngram`, `model:NAME`, `module:Class` (a user plugin)."""

from __future__ import annotations

from drafter_service.config import DrafterServiceConfig
from drafter_service.drafters.base import Proposal, SessionDrafter, SparseDist
from drafter_service.drafters.ngram import NGramDrafter

__all__ = ["NGramDrafter", "Proposal", "SessionDrafter", "SparseDist", "build_drafter"]


def build_drafter(config: DrafterServiceConfig) -> SessionDrafter:
    """The drafter named by `config.drafter` (loads the model for `model:NAME`)."""
    if config.drafter == "ngram":
        return NGramDrafter(config.max_ngram, config.prefer)
    kind, _, arg = config.drafter.partition(":")
    if kind == "model":
        return _build_model_drafter(arg, config)
    from drafter_service.drafters.plugin import load_plugin

    return load_plugin(config.drafter)


def _build_model_drafter(name: str, config: DrafterServiceConfig) -> SessionDrafter:
    import torch

    from common.errors import UserError
    from common.model import loader as model_loader  # (imported late: it pulls in torch)
    from drafter_service.drafters.model import ModelDrafter

    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {config.device}: CUDA is not available on this machine")
    if config.dtype == "auto":
        dtype = torch.bfloat16 if config.device.startswith("cuda") else torch.float32
    else:
        dtype = getattr(torch, config.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise UserError(f"--dtype {config.dtype!r} is not a torch dtype")
    loaded = model_loader.load_model(name, device=config.device, dtype=dtype)
    return ModelDrafter(
        loaded.model,
        name=f"model:{loaded.name}",
        vocab_size=int(loaded.config.vocab_size),
        tokenizer_fingerprint=loaded.tokenizer.fingerprint,
        num_blocks=config.kv_blocks,
        probs_top_n=config.draft_probs_top_n,
        seed=config.seed,
    )
