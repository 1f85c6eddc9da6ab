"""The bridge's launch of a plan's Triton kernels (bridge/triton_launch.py), on the CPU.

The CUDA part (torch's Triton compiling the IR Pallas lowers to, the driver loading and launching it)
needs a GPU: bench/mosaic_launch_check.py --stack rows|fused --against jax runs it on the H200. Here:
reading a program into launch steps (and refusing what is not only kernels), the workspace plan, the
whole launch with each kernel evaluated by jax on views of the same workspace (InterpretedKernels, the
CPU twin), and the bridge's use of it (off by default; on, it agrees with the jax path).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import baseline_and_params, random_input

import ttj_jax as T
from bridge import settings
from bridge import triton_launch as tl
from ttj_jax import numerics, stacks
from ttj_jax.masks import MaskKind
from ttj_jax.model import executable, model_key, plan_for
from ttj_jax.params import init_params, prepare_weights

CONFIG = T.Config(2, 32, 32, 2, 32, 2, True)   # B*S = 64 rows: one row tile of the rows stack


def _program(stack: str, config=CONFIG, mask_kind=MaskKind.NONE):
    shape = (config.batch_size, config.seq_len, config.d_model)
    plan = plan_for(config, jax.ShapeDtypeStruct(shape, jnp.float32), mask_kind, device=jax.devices("cpu")[0],
                    caller="torch", stack=stack)
    prepared = prepare_weights(init_params(jax.random.PRNGKey(0), config), numerics.get_policy(plan.policy))
    weights = stacks.kernel_weights(prepared, model_key(config), stack)
    return plan, executable(plan, model_key(config)), weights


@pytest.mark.parametrize("stack, kernels", [("rows", 2 * CONFIG.num_layers + 1), ("fused", 1)])
def test_launch_of_the_program_kernels_equals_the_jax_program(stack, kernels):
    plan, run, weights = _program(stack)
    x = jax.random.normal(jax.random.PRNGKey(1), (CONFIG.batch_size, CONFIG.seq_len, CONFIG.d_model))
    launch = tl.TritonProgramLaunch(run, weights, jax.ShapeDtypeStruct(x.shape, x.dtype), None,
                                    torch.device("cpu"), kernels=tl.InterpretedKernels)
    assert launch.num_kernels == kernels
    tensors = [torch.from_numpy(np.array(a)) for a in jax.tree_util.tree_leaves(weights)]
    x_torch = torch.from_numpy(np.array(x))
    x_before = x_torch.clone()
    y = launch(x_torch, None, tensors)
    assert torch.equal(x_torch, x_before)
    np.testing.assert_array_equal(y.numpy(), np.asarray(run(weights, x, None)))


def test_the_workspace_reuses_the_bytes_of_arrays_no_longer_read():
    _, run, weights = _program("rows")
    structs = jax.ShapeDtypeStruct((CONFIG.batch_size, CONFIG.seq_len, CONFIG.d_model), jnp.float32)
    program = tl.program_steps(jax.make_jaxpr(run)(weights, structs, None))
    written = sum(tl._nbytes(v.aval) for step in program.steps for v in step.eqn.outvars)
    assert 0 < program.workspace_bytes <= written / 2
    out = program.output_base
    assert [r.base for r in program.steps[-1].outputs] == [out]


def test_plan_buffers_never_lets_a_kernel_write_over_a_live_array():
    # A random chain: each kernel reads some earlier arrays and writes one or two new ones.
    rng = np.random.default_rng(0)
    for trial in range(50):
        names = itertools.count()
        arrays, kernels = [], []
        for _ in range(int(rng.integers(2, 12))):
            reads = [a for a in arrays if rng.random() < 0.4]
            writes = [next(names) for _ in range(int(rng.integers(1, 3)))]
            kernels.append((writes, reads))
            arrays += writes
        sizes = {a: int(rng.integers(1, 2000)) for a in arrays}
        last_read = {}
        for index, (_, reads) in enumerate(kernels):
            for a in reads:
                last_read[a] = index
        offsets, total = tl.plan_buffers(kernels, sizes, last_read)
        live: set = set()
        for index, (writes, reads) in enumerate(kernels):
            for a in writes:
                assert offsets[a] % tl._ALIGN == 0 and offsets[a] + sizes[a] <= total
                for b in live | set(reads):   # arrays still to be read, and this kernel's inputs
                    if b in writes:
                        continue
                    apart = offsets[a] + sizes[a] <= offsets[b] or offsets[b] + sizes[b] <= offsets[a]
                    assert apart, (trial, index, a, b)
            for a in writes:
                if last_read.get(a, -1) > index:
                    live.add(a)
            live = {b for b in live if last_read[b] > index}


def test_a_program_with_work_outside_the_kernels_is_refused_by_name():
    _, run, weights = _program("layers")
    structs = jax.ShapeDtypeStruct((CONFIG.batch_size, CONFIG.seq_len, CONFIG.d_model), jnp.float32)
    with pytest.raises(tl.NotReplayable, match="outside a Pallas kernel"):
        tl.program_steps(jax.make_jaxpr(run)(weights, structs, None))


def test_reshapes_and_byte_preserving_casts_are_views_and_other_casts_are_refused():
    def body(x):
        return x.reshape(-1).astype(jnp.float16)
    with pytest.raises(tl.NotReplayable, match="a cast from float32 to float16"):
        tl.program_steps(jax.make_jaxpr(body)(jax.ShapeDtypeStruct((4, 4), jnp.float32)))
    with pytest.raises(tl.NotReplayable, match="not written by a kernel"):
        tl.program_steps(jax.make_jaxpr(lambda m: m.astype(jnp.int8).reshape(-1))(
            jax.ShapeDtypeStruct((4, 4), jnp.bool_)))


def test_ptx_entry_reads_the_kernel_name_and_its_parameters():
    ptx = ".visible .entry ttj_rows_entry(\n\t.param .u64 .ptr .global .align 1 p0,\n\t.param .u64 p1,\n\t.param .u64 p2\n)\n{}"
    name, params, declaration = tl.ptx_entry(ptx)
    assert (name, params) == ("ttj_rows_entry", 3) and declaration.startswith(".entry ttj_rows_entry(")
    with pytest.raises(tl.NotReplayable, match="2 kernel entries"):
        tl.ptx_entry(ptx + ptx)


def test_the_launch_is_off_by_default_and_says_so(monkeypatch):
    monkeypatch.delenv(settings.TRITON_LAUNCH_ENV, raising=False)
    assert not settings.triton_launch()
    assert settings.TRITON_LAUNCH_ENV in tl.unavailable_reason(torch.device("cuda", 0))
    monkeypatch.setenv(settings.TRITON_LAUNCH_ENV, "1")
    assert "not a CUDA device" in tl.unavailable_reason(torch.device("cpu"))


@pytest.mark.slow
def test_bridge_runs_the_rows_program_kernels_itself_when_on_and_matches_the_jax_path(monkeypatch):
    import bridge
    from bridge import runtime
    baseline, _ = baseline_and_params(CONFIG, 5)
    ours = bridge.TTJTransformer(CONFIG)
    ours.load_state_dict(baseline.state_dict())
    x = random_input(CONFIG, 6)
    with torch.inference_mode():   # off (the default): through jax, and the note says why
        through_jax = runtime.forward(ours, x, stack="rows")
    [call] = [c for k, c in runtime._STATES[ours].calls.items() if k[-1] == "rows"]
    assert call.direct is None and settings.TRITON_LAUNCH_ENV in call.direct_note

    ours = bridge.TTJTransformer(CONFIG)
    ours.load_state_dict(baseline.state_dict())
    monkeypatch.setenv(settings.TRITON_LAUNCH_ENV, "1")
    monkeypatch.setattr(tl, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(tl, "kernels_for", lambda device: tl.InterpretedKernels)
    x_before = x.clone()
    with torch.inference_mode():
        y = runtime.forward(ours, x, stack="rows")
        again = runtime.forward(ours, x, stack="rows")
    [call] = [c for k, c in runtime._STATES[ours].calls.items() if k[-1] == "rows"]
    assert call.direct is not None, call.direct_note
    assert torch.equal(x, x_before) and torch.equal(y, again) and torch.equal(y, through_jax)
