"""`TTJTransformer`: the harness's module structure (so state_dicts load strictly both ways), with a
forward that runs ttj-jax through the bridge."""

from __future__ import annotations

import torch.nn as nn

from bridge.ops import forward as _forward
from bridge.ops import register
from bridge.versions import share_version_counter
from ttj_jax.config import Config


class _Attention(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        d = config.d_model
        self.num_heads = config.num_heads
        self.causal = config.causal
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)


class _Layer(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.d_model)
        self.attention = _Attention(config)
        self.norm2 = nn.LayerNorm(config.d_model)
        self.ffn_in = nn.Linear(config.d_model, config.ffn_dim)
        self.ffn_out = nn.Linear(config.ffn_dim, config.d_model)


class TTJTransformer(nn.Module):
    """Parameters named exactly as the harness's (`layers.{i}.attention.q_proj.weight`, ...; docs/spec.md),
    PyTorch's default init; `forward(x, valid_token_mask=None)` runs ttj-jax; in grad mode it records for autograd (bridge/autograd.py).
    Works under torch.compile and torch.export (bridge/ops.py). Its parameters share one version counter
    (bridge/versions.py), so a call checks them for in-place writes with one read."""

    def __init__(self, config):
        super().__init__()
        self.config = Config.from_object(config)
        self.layers = nn.ModuleList(_Layer(self.config) for _ in range(self.config.num_layers))
        self.final_norm = nn.LayerNorm(self.config.d_model)
        share_version_counter(self)
        self.ttj_handle = register(self)   # names this module inside compiled graphs (bridge/ops.py)

    def __setstate__(self, state):   # copy.deepcopy and unpickling: a copy gets a handle of its own
        super().__setstate__(state)
        self.ttj_handle = register(self)

    def forward(self, x, valid_token_mask=None):
        return _forward(self, x, valid_token_mask)
