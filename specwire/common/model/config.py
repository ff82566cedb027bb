"""Model configuration for the llama family (Llama, SmolLM2, Qwen2-style qkv bias, Mistral)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from specwire.common.errors import UserError


class ModelError(UserError):
    """A model cannot be loaded: unknown name, missing/corrupt file, unsupported architecture.

    The CLI prints its message as one line and exits non-zero.
    """


SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as Hugging Face configs describe it (`rope_scaling`)."""

    kind: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("default", "linear", "llama3"):
            raise ModelError(f"unsupported rope_scaling type {self.kind!r}")
        if self.factor <= 0:
            raise ModelError(f"rope_scaling factor must be > 0, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = dataclasses.field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelError(
                f"unsupported architecture {self.architecture!r} "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelError(f"model config: {name} must be > 0")

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dictionary."""
        archs = cfg.get("architectures") or [_arch_from_model_type(cfg.get("model_type", ""))]
        if archs[0] not in SUPPORTED_ARCHITECTURES:
            # Checked before the fields: another family's config lacks llama's keys, and
            # "unsupported architecture" is the message that helps.
            raise ModelError(
                f"unsupported architecture {archs[0]!r} "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if (
            cfg.get("sliding_window")
            and cfg.get("use_sliding_window", True)
            and (cfg.get("model_type") == "mistral")
        ):
            raise ModelError("Mistral with a sliding window is not supported")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
            kind = rs.get("rope_type", rs.get("type", "default")) if rs else "default"
            scaling = RopeScaling(
                kind=kind,
                factor=float(rs.get("factor", 1.0)),
                low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(
                    rs.get("original_max_position_embeddings", 8192)
                ),
            )
            theta = cfg.get("rope_theta", rs.get("rope_theta", 10000.0) if rs else 10000.0)
            return cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                rope_theta=float(theta),
                rope_scaling=scaling,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", archs[0] == "Qwen2ForCausalLM")),
                architecture=archs[0],
            )
        except KeyError as exc:
            raise ModelError(f"model config is missing {exc.args[0]!r}") from exc

    def to_hf_dict(self) -> dict[str, Any]:
        """The equivalent Hugging Face config.json (used to build reference models in tests)."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": {"MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}.get(
                self.architecture, "llama"
            ),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
        }
        if self.rope_scaling.kind != "default":
            rs = self.rope_scaling
            d["rope_scaling"] = {
                "rope_type": rs.kind,
                "factor": rs.factor,
                "low_freq_factor": rs.low_freq_factor,
                "high_freq_factor": rs.high_freq_factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings,
            }
        return d


def _arch_from_model_type(model_type: str) -> str:
    return {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}.get(
        model_type, "Qwen2ForCausalLM" if model_type == "qwen2" else model_type or "unknown"
    )


# Named shapes used by tests and benchmarks (random weights of the real shapes).
TINY_RANDOM = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)
SMOLLM2_135M = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
LLAMA3_8B = ModelConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
# Published shapes between those two (Qwen2.5 with its qkv bias), for the exact mode's cost:
# at most +4 % for SmolLM2-360M and Qwen2.5-1.5B, +21 % for Llama-3.2-1B (bench/RESULTS.md,
# round 22).
SMOLLM2_360M = dataclasses.replace(
    SMOLLM2_135M,
    hidden_size=960,
    intermediate_size=2560,
    num_layers=32,
    num_heads=15,
    num_kv_heads=5,
)
QWEN2_5_1_5B = dataclasses.replace(
    LLAMA3_8B,
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_layers=28,
    num_heads=12,
    num_kv_heads=2,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    attention_bias=True,
)
LLAMA3_2_1B = dataclasses.replace(
    LLAMA3_8B,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    head_dim=64,
    tie_word_embeddings=True,
)
