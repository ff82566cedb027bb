"""Read a llama-architecture GGUF file into a `Checkpoint` (dequantized, Hugging Face names).

The `gguf` package parses the file and dequantizes every tensor type llama.cpp writes; its tensor
name map translates `blk.N.attn_q` back to `model.layers.N.self_attn.q_proj`. One quirk needs
undoing by hand: llama.cpp's converter interleaves the rows of q and k so its RoPE can rotate
adjacent pairs, while HF (and `LlamaModel`) rotate the two halves of each head.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tqdm import tqdm

from specwire.common.model.checkpoint import Checkpoint, check_tensors, hf_tensor_shapes
from specwire.common.model.config import ModelConfig, ModelError
from specwire.common.tokenizer import Tokenizer

# GGUF `general.architecture` -> the HF architecture we load it as.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}

# What the gguf reader raises on a truncated or garbled file.
_READ_ERRORS = (ValueError, IndexError, KeyError, OSError, EOFError)


class PlainViewReader(gguf.GGUFReader):
    """`gguf.GGUFReader` over a plain ndarray view of its file mapping. The reader slices its
    `data` once per metadata value and tensor, and a slice of an `np.memmap` runs Python code
    (`__array_finalize__`); SmolLM2's ~100k vocabulary and merge strings made that 2.4 s of a
    3.5 s load on the dev VM, 0.65 s with the plain view. Same bytes, same mapping."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)


def read_gguf(path: Path, *, progress: bool = True) -> Checkpoint:
    try:
        reader = PlainViewReader(path)
    except _READ_ERRORS as exc:
        raise ModelError(f"cannot read GGUF file {path}: {exc}") from exc
    config = gguf_model_config(path, reader)
    hf_name = _hf_names_by_gguf_name(config)
    tensors: dict[str, torch.Tensor] = {}
    try:
        bar = tqdm(reader.tensors, desc=f"loading {path.name}", unit="tensor", disable=not progress)
        for t in bar:
            if t.name == "rope_freqs.weight":
                raise ModelError(f"{path}: llama3 rope_freqs scaling in GGUF is not supported")
            name = hf_name.get(t.name)
            if name is None:
                continue
            # dequantize gives the logical [rows, cols] layout (GGUF lists dims reversed).
            weight = dequantize(t.data, t.tensor_type)
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                weight = _unpermute_rope_rows(weight, config.num_heads)
            elif name.endswith(("k_proj.weight", "k_proj.bias")):
                weight = _unpermute_rope_rows(weight, config.num_kv_heads)
            tensors[name] = weight
    except _READ_ERRORS as exc:
        raise ModelError(f"cannot read tensors of GGUF file {path}: {exc}") from exc
    check_tensors(str(path), config, tensors)
    try:
        tokenizer = Tokenizer.from_gguf(path)
    except Exception as exc:  # transformers raises assorted types for an odd vocabulary
        raise ModelError(f"cannot read the tokenizer in {path}: {exc}") from exc
    return Checkpoint(config, tensors, tokenizer)


def dequantize(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> torch.Tensor:
    """A GGUF tensor's data as fp32 in its logical [rows, cols] layout: the `gguf` package's
    `dequantize`, bit for bit, with torch doing the two types SmolLM2's file uses (Q4_1 for the
    layers, Q8_0 for the embedding; numpy took 1.0 s of the dev VM's start for them, torch
    ~0.1 s). Same operations in the same order, each rounded to fp32 on its own."""
    if qtype not in _TORCH_DEQUANT:
        return torch.from_numpy(np.array(gguf.dequantize(data, qtype), np.float32))
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = torch.from_numpy(np.array(data))  # a copy: the mapping is read-only
    blocks = raw.reshape(-1, type_size)
    values = _TORCH_DEQUANT[qtype](blocks)
    return values.reshape(*data.shape[:-1], data.shape[-1] // type_size * block_size)


def _f16(column: torch.Tensor) -> torch.Tensor:
    """Two bytes a block (little-endian fp16) -> [blocks, 1] fp32."""
    return column.contiguous().view(torch.float16).float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1: fp16 scale d, fp16 minimum m, 16 bytes of nibbles (the low ones are values 0-15,
    the high ones 16-31); value = d * q + m."""
    qs = blocks[:, 4:]
    q = torch.cat((qs & 0x0F, qs >> 4), dim=1).float()
    return (_f16(blocks[:, 0:2]) * q) + _f16(blocks[:, 2:4])


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0: fp16 scale d, 32 int8 values; value = q * d."""
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _f16(blocks[:, 0:2])


_TORCH_DEQUANT = {
    gguf.GGMLQuantizationType.Q4_1: _q4_1,
    gguf.GGMLQuantizationType.Q8_0: _q8_0,
}


def gguf_model_config(path: Path, reader: gguf.GGUFReader) -> ModelConfig:
    """The `ModelConfig` a GGUF file's `{arch}.*` metadata describes."""
    meta = _Metadata(path, reader)
    arch = meta.get(gguf.Keys.General.ARCHITECTURE)
    if arch not in GGUF_ARCHITECTURES:
        raise ModelError(
            f"{path}: unsupported GGUF architecture {arch!r} "
            f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    heads = int(meta.get(gguf.Keys.Attention.HEAD_COUNT, arch))
    hidden = int(meta.get(gguf.Keys.LLM.EMBEDDING_LENGTH, arch))
    rope_kind = meta.get(gguf.Keys.Rope.SCALING_TYPE, arch, "none")
    if rope_kind not in ("none", "linear"):
        raise ModelError(f"{path}: unsupported GGUF rope scaling {rope_kind!r}")
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    hf: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        # The embedding's rows are the model's vocabulary (the tokenizer's may be smaller).
        "vocab_size": int(embed.shape[-1]) if embed else meta.get(gguf.Keys.LLM.VOCAB_SIZE, arch),
        "hidden_size": hidden,
        "intermediate_size": meta.get(gguf.Keys.LLM.FEED_FORWARD_LENGTH, arch),
        "num_hidden_layers": meta.get(gguf.Keys.LLM.BLOCK_COUNT, arch),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(gguf.Keys.Attention.HEAD_COUNT_KV, arch, heads),
        "head_dim": meta.get(gguf.Keys.Rope.DIMENSION_COUNT, arch, hidden // heads),
        "max_position_embeddings": meta.get(gguf.Keys.LLM.CONTEXT_LENGTH, arch),
        "rms_norm_eps": meta.get(gguf.Keys.Attention.LAYERNORM_RMS_EPS, arch),
        "rope_theta": meta.get(gguf.Keys.Rope.FREQ_BASE, arch, 10000.0),
        # llama.cpp leaves out `output.weight` when the LM head shares the embedding.
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
    }
    if rope_kind == "linear":
        factor = meta.get(gguf.Keys.Rope.SCALING_FACTOR, arch)
        hf["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    return ModelConfig.from_hf_dict(hf)


class _Metadata:
    """Typed reads of GGUF key-value metadata; a missing required key is a `ModelError`."""

    _REQUIRED = object()

    def __init__(self, path: Path, reader: gguf.GGUFReader):
        self._path = path
        self._fields = reader.fields

    def get(self, key: str, arch: str = "", default: Any = _REQUIRED) -> Any:
        key = key.format(arch=arch)
        field = self._fields.get(key)
        if field is None:
            if default is self._REQUIRED:
                raise ModelError(f"{self._path}: GGUF metadata lacks {key}")
            return default
        return field.contents()


def _hf_names_by_gguf_name(cfg: ModelConfig) -> dict[str, str]:
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_layers)
    names = {}
    for hf_name in hf_tensor_shapes(cfg):
        base, suffix = hf_name.rsplit(".", 1)
        names[f"{name_map.get_name(base)}.{suffix}"] = hf_name
    return names


def _unpermute_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    # w: [heads * head_dim, ...]. llama.cpp stores each head's rows as (pair, 2) interleaved;
    # HF stores them as (2, half). Swap back.
    pairs = w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:])  # [heads, half, 2, ...]
    return pairs.transpose(1, 2).reshape(w.shape)
