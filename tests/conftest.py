"""Shared helpers: the PyTorch reference (bench/baseline.py, written from docs/spec.md), input and
mask builders, and a report of the worst |err|/tolerance seen per test under the harness rule."""

import json
import os
import subprocess
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import ttj_jax as T
from bench.baseline import BaselineTransformer, TransformerConfig, check_close

_HARNESS_REPORT: list[tuple[str, int, float]] = []

MASK_KINDS = ("none", "all_true", "prefix", "random", "all_invalid")


@pytest.fixture
def cudnn_on_cpu(monkeypatch):
    """jax.nn.dot_product_attention's cuDNN path, which cannot run on the CPU, as jax's own attention with
    the same arguments (half operands computed in fp32: the CPU has no fp16 dots). Yields the list of the
    (q, k, v) shapes each call got."""
    import jax
    given = jax.nn.dot_product_attention
    calls = []

    def on_cpu(q, k, v, *args, implementation=None, **kwargs):
        assert implementation == "cudnn"
        calls.append((q.shape, k.shape, v.shape))
        q32, k32, v32 = (t.astype(jnp.float32) for t in (q, k, v))
        return given(q32, k32, v32, *args, implementation="xla", **kwargs).astype(q.dtype)
    monkeypatch.setattr(jax.nn, "dot_product_attention", on_cpu)
    return calls


def baseline_and_params(config: T.Config, seed: int = 0):
    torch.manual_seed(seed)
    base = BaselineTransformer(TransformerConfig(**vars(config))).eval()
    return base, T.params_from_state_dict(base.state_dict(), config)


def random_input(config: T.Config, seed: int, *, batch=None, seq_len=None, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch or config.batch_size, seq_len or config.seq_len, config.d_model,
                       generator=gen) * scale


def make_mask(kind: str, batch: int, seq_len: int, seed: int):
    """A bool [B, S] mask of the named kind (None for "none"). Random masks keep position 0 invalid in
    one sequence and valid in another so that both non-prefix cases occur."""
    rng = np.random.default_rng(seed)
    if kind == "none":
        return None
    if kind == "all_true":
        mask = np.ones((batch, seq_len), bool)
    elif kind == "prefix":
        lengths = rng.integers(0, seq_len + 1, batch)
        lengths[0] = max(1, seq_len - 1)
        mask = np.arange(seq_len)[None, :] < lengths[:, None]
    elif kind == "random":
        mask = rng.random((batch, seq_len)) > 0.35
    elif kind == "first_tile_valid":   # a Mosaic stack tile (128 tokens) all valid, then random tokens
        mask = rng.random((batch, seq_len)) > 0.35
        mask.reshape(-1)[:128] = True
    elif kind == "all_invalid":
        mask = rng.random((batch, seq_len)) > 0.35
        mask[0] = False          # one sequence with no valid token at all: zeros, never NaN
    else:
        raise ValueError(kind)
    return torch.from_numpy(mask)


def torch_reference(base, x, mask):
    with torch.no_grad():
        return base(x.float(), mask)


def to_jax(t):
    return None if t is None else jnp.asarray(t.numpy())


def to_torch(a):
    return torch.from_numpy(np.array(a, dtype=np.float32))


@pytest.fixture
def harness_rule(request):
    """check(out, ref) -> asserts zero failing elements under the harness rule and records the worst
    |err|/tolerance for the end-of-run report."""
    def check(out, ref, label=""):
        failed, worst = check_close(out, ref)
        _HARNESS_REPORT.append((f"{request.node.name}{label}", failed, worst))
        assert failed == 0, f"{failed} elements fail the harness rule; worst |err|/tol {worst:.3f}"
        return worst
    return check


def pytest_terminal_summary(terminalreporter):
    if not _HARNESS_REPORT:
        return
    worst = sorted(_HARNESS_REPORT, key=lambda r: -r[2])
    terminalreporter.section("harness rule: worst |err|/tolerance (1.0 = failing)")
    terminalreporter.write_line(f"{len(_HARNESS_REPORT)} checks; the five closest to failing:")
    for name, failed, ratio in worst[:5]:
        terminalreporter.write_line(f"  {ratio:6.3f}  failed={failed}  {name}")


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_on_host_devices(args: list[str], devices: int, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python *args` from the repository root with jax on `devices` CPU devices (XLA's host platform
    split in that many; the count is fixed when jax starts, hence a subprocess). Asserts it succeeded."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=REPO_ROOT)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    return done


def last_json_line(done: subprocess.CompletedProcess):
    """The JSON object a script printed last."""
    return json.loads(done.stdout.strip().splitlines()[-1])


class RecordingPower:
    """Stands in for bench.gpu_power.PowerSampler in the benchmark runners' tests: window() records the
    (start, end) it is asked for and answers `state`."""

    def __init__(self, state: dict):
        self.state, self.asked = state, []

    def window(self, start: float, end: float) -> dict:
        self.asked.append((start, end))
        return self.state
