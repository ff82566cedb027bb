"""torch.compile of the decoder's math between two attention calls (bench-only, issue 8).

`CompiledOps(model, mode).attach()` swaps the model's forward for one that runs the same
PyTorch math (`TorchOps`, the same formulas) as three compiled functions around the attention
backend, which stays as it is (Triton on CUDA, SDPA on the CPU):

- `first`:  embedding gather, RoPE cos/sin gather, layer 0's norm + qkv GEMM + RoPE
- `middle`: layer i's o_proj, add + norm, gate_up GEMM, SiLU·up, down GEMM, then layer i+1's
            add + norm, qkv GEMM and RoPE -- the whole stretch between two attention calls
- `last`:   the last layer's o_proj ... down GEMM, then the final add + norm

The weights are arguments (plain detached tensors), so every layer shares ONE compiled graph of
`middle` per token count: no per-layer recompiles. `dynamic=False`, `fullgraph=True`: one
compile per distinct token count T and function, in the eager warm-up the runner does before
it captures a CUDA graph (compiling or autotuning inside a capture would fail). The LM head
(`compute_logits`) stays eager.

Modes: "default" and "max-autotune" (torch.compile mode "max-autotune-no-cudagraphs": the GEMMs
autotuned between cuBLAS and Triton templates). Inductor never uses its own CUDA graphs here
(`triton.cudagraphs` stays off): its kernels are captured inside the runner's graph of the
whole step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specwire.common.model.attention import prepare_uniform_mask
from specwire.common.model.llama import LlamaModel
from specwire.common.model.ops import TorchOps

if TYPE_CHECKING:
    from specwire.target_service.runner.model_runner import ModelRunner
    from specwire.target_service.scheduler import Row

# --compile value -> torch.compile mode
MODES = {"default": "default", "max-autotune": "max-autotune-no-cudagraphs"}
_T = TorchOps()


def _configure() -> None:
    """One compiled graph per (function, token count): allow many of them per code object."""
    cfg = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 1024))
    # Inductor's own CUDA graphs would nest in (and fight) the runner's: they must stay off.
    assert not torch._inductor.config.triton.cudagraphs, "inductor cudagraphs must be off"


def _functions(model: LlamaModel):
    cfg = model.cfg
    eps = cfg.rms_norm_eps
    heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qk_size = (heads + kv_heads) * d

    def pre(x, residual, ln_w, qkv_w, qkv_b, cos, sin):
        """Layer input (add +) norm, qkv GEMM, RoPE on q and k -> (qk, v, residual)."""
        qkv, residual = _T.add_norm_linear(x, residual, ln_w, eps, qkv_w, qkv_b)
        t = qkv.shape[0]
        qk = _T.rope(qkv[:, :qk_size].view(t, heads + kv_heads, d), cos, sin)
        return qk, qkv[:, qk_size:].view(t, kv_heads, d), residual

    def post(attn, residual, o_w, ln_w, gate_up_w, down_w):
        """o_proj, add + norm, gate_up GEMM, SiLU·up, down GEMM -> (delta, residual)."""
        x = _T.linear(attn, o_w)
        gate_up, residual = _T.add_norm_linear(x, residual, ln_w, eps, gate_up_w)
        return _T.silu_linear(gate_up, down_w), residual

    def first(ids, positions, emb_w, cos_t, sin_t, ln_w, qkv_w, qkv_b):
        x = torch.nn.functional.embedding(ids, emb_w)
        cos = cos_t[positions].unsqueeze(1).to(x.dtype)
        sin = sin_t[positions].unsqueeze(1).to(x.dtype)
        return (*pre(x, None, ln_w, qkv_w, qkv_b, cos, sin), cos, sin)

    def middle(attn, residual, o_w, ln2_w, gate_up_w, down_w, ln1_w, qkv_w, qkv_b, cos, sin):
        x, residual = post(attn, residual, o_w, ln2_w, gate_up_w, down_w)
        return pre(x, residual, ln1_w, qkv_w, qkv_b, cos, sin)

    def last(attn, residual, o_w, ln2_w, gate_up_w, down_w, norm_w):
        x, residual = post(attn, residual, o_w, ln2_w, gate_up_w, down_w)
        return _T.add_rms_norm(x, residual, norm_w, eps)[0]

    return first, middle, last


class CompiledOps(TorchOps):
    """The model's ops label while attached (`compute_logits` uses the plain `TorchOps` path);
    the compiled functions and the per-layer weights they are called with."""

    def __init__(self, model: LlamaModel, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown compile mode {mode!r} (use {', '.join(MODES)})")
        if model.cfg.num_layers < 1:
            raise ValueError("a compiled forward needs at least one layer")
        _configure()
        torch._dynamo.reset()  # nothing compiled for an earlier variant is reused
        self.model = model
        self.mode = mode
        self.name = f"compiled-{mode}"
        self.first, self.middle, self.last = (
            torch.compile(f, mode=MODES[mode], fullgraph=True, dynamic=False)
            for f in _functions(model)
        )

        def w(p):
            return None if p is None else p.detach()

        self.pre_w = [
            (w(la.input_layernorm.weight), w(la.qkv_proj.weight), w(la.qkv_proj.bias))
            for la in model.layers
        ]
        self.post_w = [
            (
                w(la.o_proj.weight),
                w(la.post_attention_layernorm.weight),
                w(la.gate_up_proj.weight),
                w(la.down_proj.weight),
            )
            for la in model.layers
        ]
        self.emb_w = w(model.embed_tokens.weight)
        self.norm_w = w(model.norm.weight)

    def attach(self) -> None:
        """Run the model through the compiled functions (its forward swapped on the instance)."""
        self.model.set_ops(self)
        self.model.forward = self.forward

    def detach(self) -> None:
        """Back to the model's own forward, with plain `TorchOps`."""
        self.model.__dict__.pop("forward", None)
        self.model.set_ops(TorchOps())

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_caches, meta):  # LlamaModel.forward's contract
        model, attn = self.model, self.model.attention
        cfg = model.cfg
        heads, q_size = cfg.num_heads, cfg.num_heads * cfg.head_dim
        if not attn.varlen and meta.is_uniform and meta.uniform_mask is None:
            prepare_uniform_mask(meta, model.block_size, self.emb_w.dtype)
        rot = model.rotary
        qk, v, residual, cos, sin = self.first(
            input_ids, positions, self.emb_w, rot.cos, rot.sin, *self.pre_w[0]
        )
        t = qk.shape[0]
        last = cfg.num_layers - 1
        for i in range(cfg.num_layers):
            out = attn.forward(qk[:, :heads], qk[:, heads:], v, kv_caches[i], meta)
            out = out.reshape(t, q_size)
            if i < last:
                qk, v, residual = self.middle(
                    out, residual, *self.post_w[i], *self.pre_w[i + 1], cos, sin
                )
        return self.last(out, residual, *self.post_w[last], self.norm_w)


def _step_logits(runner: ModelRunner, step) -> torch.Tensor:
    """The step's verify logits (every decode row's span, in order), as a new tensor."""
    runner.wait(step)
    return torch.cat([step.logits[o : o + n] for o, n in step.spans]).clone()


def check_logits(
    model: LlamaModel,
    compiled: CompiledOps | None,
    runner: ModelRunner,
    rows: list[Row],
    tables: list[list[int]],
) -> dict:
    """Max abs difference of the current variant's logits (eager, and graph replay where a
    graph is captured) from the uncompiled `TorchOps` model's eager logits, same inputs. For
    an uncompiled variant (e.g. the Triton ops on a GPU) it is the bf16 noise to compare with.

    Each forward writes this step's K/V into the same slots before it attends, so every run
    reads its own: the comparison is of the whole step."""
    ops = model.ops
    if compiled is not None:
        compiled.detach()
    model.set_ops(TorchOps())
    try:
        ref = _step_logits(runner, runner.forward(rows, tables, allow_graphs=False))
    finally:
        if compiled is not None:
            compiled.attach()
        else:
            model.set_ops(ops)
    eager = _step_logits(runner, runner.forward(rows, tables, allow_graphs=False))
    graph = None
    step = runner.forward(rows, tables)
    if step.graph is not None:
        graph = (_step_logits(runner, step) - ref).abs().max().item()
    return dict(
        max_abs_diff_eager=(eager - ref).abs().max().item(),
        max_abs_diff_graph=graph,
        ref_max_abs_logit=ref.abs().max().item(),
    )
