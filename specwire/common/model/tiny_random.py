"""The `tiny-random` model: TINY_RANDOM's shapes, seeded random weights, a real byte-level BPE.

Built in code, in well under a second, identically on every run and machine: tests and CI runs
use it where the numbers need not mean anything but text must round-trip.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from tokenizers import Tokenizer as CoreTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from specwire.common.model.checkpoint import Checkpoint, hf_tensor_shapes
from specwire.common.model.config import TINY_RANDOM
from specwire.common.tokenizer import Tokenizer

SEED = 0
# 1/sqrt(hidden): unit gain per projection. At 0.02 the residual stream swamps both layers and
# greedy decoding repeats one token forever, which makes a poor stand-in for a real model.
INIT_STD = TINY_RANDOM.hidden_size**-0.5
TOKENIZER_VOCAB = 320  # 2 specials + 256 bytes + 62 merges; TINY_RANDOM has 512 embedding rows
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# The merges are learned from this text, so common English fragments get their own ids.
_TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding lets a small drafter "
    "propose tokens that the target model then verifies in one forward pass. The target keeps "
    "the tokens it agrees with and the first token where it disagrees, so the output is the "
    "same as decoding with the target alone, only faster when the drafter guesses well. "
    "Once upon a time there was a little model that wanted to write the next token of every "
    "story it read, and it read many stories about the sea, the sky and the stars."
)


def tiny_random_checkpoint() -> Checkpoint:
    """Weights ~N(0, INIT_STD) (norm weights near 1), from a fixed seed on the CPU."""
    gen = torch.Generator().manual_seed(SEED)
    tensors = {}
    for name, shape in hf_tensor_shapes(TINY_RANDOM).items():
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        # Norm weights near 1 rather than exactly 1, so tests notice a norm weight applied wrong.
        tensors[name] = 1.0 + 0.1 * noise if len(shape) == 1 else INIT_STD * noise
    return Checkpoint(TINY_RANDOM, tensors, tiny_tokenizer())


@lru_cache(maxsize=1)
def tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE: `<s>` = 0, `</s>` = 1, the 256 bytes, then merges. Adds BOS."""
    core = CoreTokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator([_TRAINING_TEXT], trainer=trainer)
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
    )
    return Tokenizer.from_core(core, bos_token="<s>", eos_token="</s>", chat_template=CHAT_TEMPLATE)
