"""Our model gives Hugging Face's logits: `transformers.LlamaForCausalLM` loaded with the same
weights (the exported folder), fp32 on the CPU, real prompts through the real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from paged_runner import prompt_logits
from transformers import LlamaForCausalLM

from specwire.common.model.loader import LoadedModel, export_hf_folder

TOL = 1e-3
PROMPTS = [
    "The capital of France is",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # naïve — 東京 🤖",
]
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


def hf_reference(folder: Path) -> LlamaForCausalLM:
    model = LlamaForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def hf_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:  # [T, V]
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


def max_diff(loaded: LoadedModel, reference: LlamaForCausalLM) -> float:
    tok = loaded.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS] + [tok.apply_chat_template(CHAT)]
    return max(
        (prompt_logits(loaded.model, ids) - hf_logits(reference, ids)).abs().max().item()
        for ids in prompts
    )


def test_tiny_random_matches_transformers(tiny: LoadedModel, tmp_path: Path) -> None:
    reference = hf_reference(export_hf_folder("tiny-random", tmp_path, progress=False))
    diff = max_diff(tiny, reference)
    assert diff <= TOL, f"max abs logit diff {diff:.2e}"


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2: LoadedModel, smollm2_folder: Path) -> None:
    diff = max_diff(smollm2, hf_reference(smollm2_folder))
    assert diff <= TOL, f"max abs logit diff {diff:.2e}"


EIFFEL = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower. "
    "Locally nicknamed the Iron Lady, it was constructed from 1887 to 1889 as the centerpiece of "
    "the 1889 World's Fair."
)


@pytest.mark.slow
def test_smollm2_from_gguf_predicts_real_text(smollm2: LoadedModel) -> None:
    """Transformers agrees with us on whatever weights we hand it, so this checks the weights
    themselves. Measured: 1.92 nats/token; with the GGUF's q/k rows left in llama.cpp's RoPE
    order, 3.62 (while greedy decoding still says "Paris", so that is no test)."""
    ids = smollm2.tokenizer.encode(EIFFEL)
    logits = prompt_logits(smollm2.model, ids)  # [T, V]
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item()
    assert nll < 2.5, f"{nll:.2f} nats/token"
