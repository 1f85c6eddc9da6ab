"""A faithful replica of the user's harness script (`torch_transformer_benchmark.py`, docs/spec.md).

`BaselineTransformer` is docs/spec.md's model written the way the harness writes it: explicit `[B, H, S, S]`
scores, fp32, eager PyTorch. It is the PyTorch reference that the tests and benchmarks compare against,
and the class a harness user's `UserOptimizedTransformer` inherits from.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# The harness's current accuracy rule (an earlier release used 0.001 / 0.01).
ATOL = 0.002
RTOL = 0.02


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    batch_size: int
    seq_len: int
    d_model: int
    num_heads: int
    ffn_dim: int
    num_layers: int
    causal: bool = True


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config.d_model
        self.num_heads = config.num_heads
        self.head_dim = d // config.num_heads
        self.causal = config.causal
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x, valid_token_mask=None):
        B, S, d = x.shape
        split = lambda t: t.view(B, S, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, S, hd)
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.head_dim ** -0.5          # (B, H, S, S)
        if self.causal:
            future = torch.ones(S, S, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        if valid_token_mask is not None:
            scores = scores.masked_fill(~valid_token_mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(x.dtype)
        context = torch.matmul(probs, v).transpose(1, 2).reshape(B, S, d)
        out = self.out_proj(context)
        if valid_token_mask is not None:
            out = out.masked_fill(~valid_token_mask[:, :, None], 0.0)
        return out


class Layer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.d_model)
        self.attention = Attention(config)
        self.norm2 = nn.LayerNorm(config.d_model)
        self.ffn_in = nn.Linear(config.d_model, config.ffn_dim)
        self.ffn_out = nn.Linear(config.ffn_dim, config.d_model)

    def forward(self, x, valid_token_mask=None):
        x = x + self.attention(self.norm1(x), valid_token_mask)
        x = x + self.ffn_out(F.gelu(self.ffn_in(self.norm2(x))))        # exact (erf) GELU
        if valid_token_mask is not None:
            x = x.masked_fill(~valid_token_mask[:, :, None], 0.0)
        return x


class BaselineTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_layers))
        self.final_norm = nn.LayerNorm(config.d_model)

    def forward(self, x, valid_token_mask=None):
        for layer in self.layers:
            x = layer(x, valid_token_mask)
        y = self.final_norm(x)
        if valid_token_mask is not None:
            y = y.masked_fill(~valid_token_mask[:, :, None], 0.0)
        return y


def copy_model_weights(baseline: nn.Module, optimized: nn.Module, strict: bool = True):
    return optimized.load_state_dict(copy.deepcopy(baseline.state_dict()), strict=strict)


def harness_models(config, optimized_class, *, device="cpu", dtype=torch.float32, seed: int = 0):
    """The harness's step 1: both models built on the CPU from one config, weights copied strictly,
    then `.to(device=device, dtype=dtype).eval()` on each. Returns (baseline, optimized)."""
    config = TransformerConfig(**{k: getattr(config, k) for k in TransformerConfig.__dataclass_fields__})
    torch.manual_seed(seed)
    baseline = BaselineTransformer(config)
    optimized = optimized_class(config)
    copy_model_weights(baseline, optimized, strict=True)
    return (baseline.to(device=device, dtype=dtype).eval(), optimized.to(device=device, dtype=dtype).eval())


def make_inputs(config, seed: int, *, padding_ratio: float = 0.0, input_scale: float = 1.0,
                device="cpu", dtype=torch.float32, batch_size=None, seq_len=None):
    """The harness's accuracy/timing input: `randn * input_scale` and a mask that is an all-True tensor
    (not None) when padding_ratio == 0, else prefix masks with lengths in [round(S*(1-p)), S] and x zeroed
    at invalid rows."""
    B = batch_size or config.batch_size
    S = seq_len or config.seq_len
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, config.d_model, generator=gen) * input_scale
    mask = torch.ones(B, S, dtype=torch.bool)
    if padding_ratio > 0:
        low = round(S * (1 - padding_ratio))
        lengths = torch.randint(low, S + 1, (B,), generator=gen)
        mask = torch.arange(S)[None, :] < lengths[:, None]
        x = x.masked_fill(~mask[:, :, None], 0.0)
    return x.to(device=device, dtype=dtype), mask.to(device)


# Elements per step of check_close: bounds its float64 temporaries (~40 bytes per element) to ~0.7 GB.
CHECK_CHUNK_ELEMENTS = 1 << 24


def check_close(out: torch.Tensor, ref: torch.Tensor, atol: float = ATOL, rtol: float = RTOL):
    """The harness's rule, element by element: both finite and |out-ref| <= atol or <= rtol*|ref|.
    Returns (failed_elements, worst error/tolerance), the latter > 1 exactly when something failed.
    Computed in float64 on `out`'s device (a GPU compares a 164M-element output in milliseconds where
    the host took seconds), in chunks of CHECK_CHUNK_ELEMENTS so memory stays bounded at any size."""
    if out.shape != ref.shape:
        raise ValueError(f"output shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    out, ref = out.detach().reshape(-1), ref.detach().reshape(-1)
    failed, worst = 0, 0.0
    for start in range(0, out.numel(), CHECK_CHUNK_ELEMENTS):
        o = out[start:start + CHECK_CHUNK_ELEMENTS].double()
        r = ref[start:start + CHECK_CHUNK_ELEMENTS].to(o.device).double()
        tolerance = torch.clamp(rtol * r.abs(), min=atol)
        finite = torch.isfinite(o) & torch.isfinite(r)
        ratio = torch.where(finite, (o - r).abs() / tolerance, torch.full_like(o, math.inf))
        failed += int((ratio > 1).sum())
        worst = max(worst, float(ratio.max()))
    return failed, worst
