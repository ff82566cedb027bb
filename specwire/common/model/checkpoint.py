"""A model's weights as Hugging Face names them, plus its config and tokenizer; HF folders.

Every source (HF folder, GGUF file, the built-in tiny-random model) is read into a `Checkpoint`
with `LlamaForCausalLM` tensor names, checked against the config here, then loaded into
`LlamaModel`. Writing a `Checkpoint` back out gives a folder transformers can load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from specwire.common.model.config import ModelConfig, ModelError
from specwire.common.tokenizer import Tokenizer


@dataclass(frozen=True)
class Checkpoint:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]  # HF LlamaForCausalLM names -> weights
    tokenizer: Tokenizer


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a `LlamaForCausalLM` checkpoint of `cfg` holds, with its shape."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (cfg.hidden_size,)
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            shapes[p + f"self_attn.{name}_proj.weight"] = (rows, cfg.hidden_size)
            if cfg.attention_bias:
                shapes[p + f"self_attn.{name}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (cfg.hidden_size, q)
        shapes[p + "post_attention_layernorm.weight"] = (cfg.hidden_size,)
        shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, cfg.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, cfg.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (cfg.hidden_size, cfg.intermediate_size)
    shapes["model.norm.weight"] = (cfg.hidden_size,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def check_tensors(where: str, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Raise `ModelError` naming the first missing or misshapen tensor."""
    for name, shape in hf_tensor_shapes(cfg).items():
        if name not in tensors:
            raise ModelError(f"{where}: missing tensor {name}")
        if tuple(tensors[name].shape) != shape:
            raise ModelError(
                f"{where}: tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}"
            )


def read_hf_folder(folder: Path, *, progress: bool = True) -> Checkpoint:
    """config.json + *.safetensors (one file or shards) + tokenizer.json."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelError(f"model folder {folder} has no config.json")
    try:
        config = ModelConfig.from_hf_dict(json.loads(config_path.read_text()))
    except (ValueError, TypeError, AttributeError) as exc:  # bad JSON, or values of odd types
        raise ModelError(f"cannot read {config_path}: {exc}") from exc
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ModelError(f"model folder {folder} has no *.safetensors weights")
    if not (folder / "tokenizer.json").is_file():
        raise ModelError(f"model folder {folder} has no tokenizer.json")
    tensors: dict[str, torch.Tensor] = {}
    try:
        with tqdm(desc=f"loading {folder.name}", unit="tensor", disable=not progress) as bar:
            for shard in shards:
                with safe_open(shard, framework="pt", device="cpu") as f:
                    for name in f.keys():
                        tensors[name] = f.get_tensor(name)
                        bar.update()
    except (SafetensorError, OSError) as exc:
        raise ModelError(f"cannot read weights in {folder}: {exc}") from exc
    check_tensors(str(folder), config, tensors)
    try:
        tokenizer = Tokenizer.from_folder(folder)
    except Exception as exc:  # transformers raises assorted types for a bad tokenizer.json
        raise ModelError(f"cannot read the tokenizer in {folder}: {exc}") from exc
    return Checkpoint(config, tensors, tokenizer)


def write_hf_folder(ckpt: Checkpoint, folder: Path) -> None:
    """Write `ckpt` as a folder `transformers.LlamaForCausalLM.from_pretrained` can load."""
    folder.mkdir(parents=True, exist_ok=True)
    hf_config = ckpt.config.to_hf_dict()
    hf_config["torch_dtype"] = "float32"
    hf_config["bos_token_id"] = ckpt.tokenizer.bos_token_id
    hf_config["eos_token_id"] = ckpt.tokenizer.eos_token_id
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    names = hf_tensor_shapes(ckpt.config)  # drops a tied lm_head: safetensors stores no aliases
    tensors = {n: ckpt.tensors[n].contiguous() for n in names}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    ckpt.tokenizer.save(folder)
