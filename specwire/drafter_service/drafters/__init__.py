"""The drafter the service runs, from its flags: `ngram`, `model:NAME` or `module:Class`.

The drafters themselves live in specwire/common/drafters/ (the target runs the same ones
in-process);
their contract is specwire/common/drafting.py.
"""

from __future__ import annotations

from specwire.common.drafters import NGramDrafter, load_model_drafter, load_plugin
from specwire.common.drafting import Proposal, SessionDrafter, SparseDist
from specwire.common.errors import UserError
from specwire.drafter_service.config import DrafterServiceConfig

__all__ = ["NGramDrafter", "Proposal", "SessionDrafter", "SparseDist", "build_drafter"]


def build_drafter(config: DrafterServiceConfig) -> SessionDrafter:
    """The drafter named by `config.drafter` (loads the model for `model:NAME`)."""
    if config.drafter == "ngram":
        return NGramDrafter(config.max_ngram, config.prefer, config.ngram_vote)
    kind, _, arg = config.drafter.partition(":")
    if kind == "model":
        return _build_model_drafter(arg, config)
    return load_plugin(config.drafter)


def _build_model_drafter(name: str, config: DrafterServiceConfig) -> SessionDrafter:
    import torch

    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {config.device}: CUDA is not available on this machine")
    if config.dtype == "auto":
        dtype = torch.bfloat16 if config.device.startswith("cuda") else torch.float32
    else:
        dtype = getattr(torch, config.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise UserError(f"--dtype {config.dtype!r} is not a torch dtype")
    return load_model_drafter(
        name,
        device=config.device,
        dtype=dtype,
        num_blocks=config.kv_blocks,
        probs_top_n=config.draft_probs_top_n,
        seed=config.seed,
    )
