"""The PyTorch side of ttj-jax: thin, it converts, caches and calls; it holds no math.

- `TTJTransformer(config)`: an nn.Module with the harness's exact parameter names; assign it as the
  harness's `UserOptimizedTransformer` (exported under that name too).
- `forward(module, x, valid_token_mask=None)`: runs ttj-jax on any module with those parameter names,
  such as `self` inside the harness's "your codes here" block.
- `stream_forward(module, x_cpu, ...)`: x in host memory streams through the device in batch chunks.
"""

import os

# jax must not take 75% of the GPU at its first operation: torch shares the device (GPU.md).
# This only works if it is set before jax initialises its GPU backend, which importing bridge first ensures.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from bridge.module import TTJTransformer  # noqa: E402
from bridge.runtime import explain, forward, refresh, stream_forward, weight_views  # noqa: E402

UserOptimizedTransformer = TTJTransformer

__all__ = ["TTJTransformer", "UserOptimizedTransformer", "forward", "explain", "refresh", "stream_forward",
           "weight_views"]
