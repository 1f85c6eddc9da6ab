"""The PyTorch side of ttj-jax: thin, it converts, caches and calls; it holds no math.

- `TTJTransformer(config)`: an nn.Module with the harness's exact parameter names; assign it as the
  harness's `UserOptimizedTransformer` (exported under that name too).
- `forward(module, x, valid_token_mask=None)`: runs ttj-jax on any module with those parameter names,
  such as `self` inside the harness's "your codes here" block.
- `stream_forward(module, x_cpu, ...)`: x in host memory streams through the device in batch chunks.
"""

from bridge import settings

settings.apply_process_defaults()   # before jax starts: see bridge/settings.py

from bridge.module import TTJTransformer  # noqa: E402
from bridge.ops import forward  # noqa: E402
from bridge.runtime import explain, refresh, stream_forward, weight_views  # noqa: E402

UserOptimizedTransformer = TTJTransformer

__all__ = ["TTJTransformer", "UserOptimizedTransformer", "forward", "explain", "refresh", "stream_forward",
           "weight_views"]
