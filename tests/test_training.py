"""Gradients through the bridge (bridge/autograd.py), on the CPU: x and every parameter against the
harness baseline's own autograd, masks included; no silent detach in any grad-mode call; inference calls
untouched."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import bridge
from bench.baseline import BaselineTransformer, TransformerConfig, copy_model_weights, make_inputs
from tests.conftest import make_mask

# relative L2 error per tensor that the gradients must meet (fp16 GEMM operands in the recomputation)
MAX_REL_L2 = 1e-2

CONFIGS = {
    "causal": TransformerConfig(batch_size=2, seq_len=16, d_model=32, num_heads=2, ffn_dim=64, num_layers=2, causal=True),
    "encoder-hd32": TransformerConfig(batch_size=3, seq_len=24, d_model=64, num_heads=2, ffn_dim=128, num_layers=2,
                                      causal=False),
    "official-4-cut": TransformerConfig(batch_size=2, seq_len=128, d_model=128, num_heads=4, ffn_dim=128, num_layers=4,
                                        causal=True),
}


class DropIn(BaselineTransformer):
    """The harness's one-line plug-in: `bridge.forward(self, ...)` inside a module of its own class."""

    def forward(self, x, valid_token_mask=None):
        return bridge.forward(self, x, valid_token_mask)


def _models(config, seed, cls=bridge.TTJTransformer):
    torch.manual_seed(seed)
    base = BaselineTransformer(config)
    ours = cls(config)
    copy_model_weights(base, ours, strict=True)
    return base, ours


def _rel(ours, ref) -> float:
    return float((ours - ref).norm() / ref.norm().clamp_min(1e-30))


def _check_gradients(base, ours, x, mask, seed):
    x_ref = x.clone().requires_grad_(True)
    x_ours = x.clone().requires_grad_(True)
    ref, out = base(x_ref, mask), ours(x_ours, mask)
    assert out.grad_fn is not None
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed))
    (ref * weights).sum().backward()
    (out * weights).sum().backward()
    assert _rel(x_ours.grad, x_ref.grad) <= MAX_REL_L2
    assert torch.equal(x_ours.grad[x_ref.grad == 0], torch.zeros_like(x_ours.grad[x_ref.grad == 0]))
    for (name, p_ref), (same, p_ours) in zip(base.named_parameters(), ours.named_parameters()):
        assert name == same.removeprefix("_orig_mod.") and p_ours.grad is not None, name
        assert p_ours.grad.dtype == p_ours.dtype and p_ours.grad.device == p_ours.device
        if name.endswith("attention.k_proj.bias"):   # zero in exact arithmetic: the reference holds its noise
            assert torch.count_nonzero(p_ours.grad) == 0
            assert float(p_ref.grad.norm()) < 1e-4 * float(base.get_parameter(
                name.replace("bias", "weight")).grad.norm())
            continue
        assert _rel(p_ours.grad, p_ref.grad) <= MAX_REL_L2, (name, _rel(p_ours.grad, p_ref.grad))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("padding", [0.0, 0.5])
def test_gradients_match_the_baselines_autograd(name, seed, padding):
    config = CONFIGS[name]
    base, ours = _models(config, seed)
    x, mask = make_inputs(config, 1234 + seed, padding_ratio=padding)
    _check_gradients(base, ours, x, mask, seed)


@pytest.mark.parametrize("kind", ["none", "random"])
def test_gradients_with_any_mask(kind):
    config = CONFIGS["encoder-hd32"]
    base, ours = _models(config, 5)
    x, _ = make_inputs(config, 5)
    _check_gradients(base, ours, x, make_mask(kind, config.batch_size, config.seq_len, 5), 5)


def test_a_sequence_without_valid_tokens_gets_zero_gradient_not_nan():
    """The baseline's own backward is NaN there (a softmax over no key); the spec's output is zeros, whose
    gradient is zero. The other sequences' gradients match the baseline's on them alone."""
    config = CONFIGS["encoder-hd32"]
    base, ours = _models(config, 5)
    x, _ = make_inputs(config, 5)
    mask = make_mask("all_invalid", config.batch_size, config.seq_len, 5)   # sequence 0 all invalid
    x_ours = x.clone().requires_grad_(True)
    out = ours(x_ours, mask)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    (out * weights).sum().backward()
    assert torch.count_nonzero(x_ours.grad[0]) == 0 and torch.isfinite(x_ours.grad).all()
    x_ref = x[1:].clone().requires_grad_(True)
    (base(x_ref, mask[1:]) * weights[1:]).sum().backward()
    assert _rel(x_ours.grad[1:], x_ref.grad) <= MAX_REL_L2
    for (name, p_ref), (_, p_ours) in zip(base.named_parameters(), ours.named_parameters()):
        assert torch.isfinite(p_ours.grad).all(), name
        if not name.endswith("attention.k_proj.bias"):
            assert _rel(p_ours.grad, p_ref.grad) <= MAX_REL_L2, name


def test_the_drop_in_gets_gradients_too():
    config = CONFIGS["causal"]
    base, ours = _models(config, 3, cls=DropIn)
    x, mask = make_inputs(config, 7, padding_ratio=0.3)
    _check_gradients(base, ours, x, mask, 3)


def test_no_silent_detach_parameters_only_and_in_eval_mode():
    """A trainable head on top, x without grad, the module in eval mode: the stack's parameters still get
    their gradients (before, they silently got none)."""
    config = CONFIGS["causal"]
    base, ours = _models(config, 4)
    base.eval(), ours.eval()
    head_ref = torch.nn.Linear(config.d_model, 3)
    head = torch.nn.Linear(config.d_model, 3)
    head.load_state_dict(head_ref.state_dict())
    x, mask = make_inputs(config, 4)
    head_ref(base(x, mask)).mean().backward()
    head(ours(x, mask)).mean().backward()
    for (name, p_ref), (_, p_ours) in zip(base.named_parameters(), ours.named_parameters()):
        assert p_ours.grad is not None, name
        if not name.endswith("attention.k_proj.bias"):
            assert _rel(p_ours.grad, p_ref.grad) <= MAX_REL_L2, name


def test_inference_calls_record_nothing():
    config = CONFIGS["causal"]
    _, ours = _models(config, 0)
    x, mask = make_inputs(config, 0)
    with torch.no_grad():
        assert ours(x, mask).grad_fn is None
    with torch.inference_mode():
        assert ours(x, mask).grad_fn is None
    for p in ours.parameters():
        p.requires_grad_(False)
    assert ours(x, mask).grad_fn is None   # nothing requires grad: the plain inference path


def test_a_training_step_changes_the_weights_and_the_next_call_sees_them():
    config = CONFIGS["causal"]
    base, ours = _models(config, 6)
    x, mask = make_inputs(config, 6)
    optimizer = torch.optim.SGD(ours.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(base.parameters(), lr=0.1)
    for _ in range(2):
        for model, opt in ((base, ref_optimizer), (ours, optimizer)):
            opt.zero_grad()
            model(x, mask).square().mean().backward()
            opt.step()
    with torch.no_grad():
        ref, out = base(x, mask), ours(x, mask)
    assert torch.allclose(out, ref, atol=2e-3, rtol=2e-2)


@pytest.mark.slow
def test_gradients_under_torch_compile():
    config = CONFIGS["causal"]
    base, ours = _models(config, 8)
    x, mask = make_inputs(config, 8, padding_ratio=0.3)
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    _check_gradients(base, compiled, x, mask, 8)


# ---- JAX callers: jax.grad of ttj_jax.forward ----

def _jax_case(config, seed, padding):
    import ttj_jax as T
    base, _ = _models(config, seed)
    x, mask = make_inputs(config, 1234 + seed, padding_ratio=padding)
    params = T.params_from_state_dict({k: v.detach().numpy() for k, v in base.state_dict().items()}, config)
    return T, base, x, mask, params


@pytest.mark.parametrize("attention", ["xla", "pallas"])
def test_jax_grad_of_forward_matches_the_baselines_autograd(attention):
    """jax.grad through forward, with our Pallas kernel forced (interpreted on the CPU; it has no
    derivative rule of its own) and with XLA's attention: x and parameter gradients against torch's."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    config = CONFIGS["causal"]
    T, base, x, mask, params = _jax_case(config, 0, 0.5)
    weights = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    x_ref = x.clone().requires_grad_(True)
    (base(x_ref, mask) * weights).sum().backward()

    def loss(p, h):
        y = T.forward(p, h, jnp.asarray(mask.numpy()), config=config, attention=attention)
        return (y * jnp.asarray(weights.numpy())).sum()
    d_params, d_x = jax.grad(loss, argnums=(0, 1))(params, jnp.asarray(x.numpy()))
    assert _rel(torch.from_numpy(np.array(d_x)), x_ref.grad) <= MAX_REL_L2
    flat = T.params_to_state_dict(d_params)
    for name, p_ref in base.named_parameters():
        if not name.endswith("attention.k_proj.bias"):
            assert _rel(torch.from_numpy(np.array(flat[name])), p_ref.grad) <= MAX_REL_L2, name


def test_jax_grad_through_prepared_weights_and_jit():
    import jax
    import jax.numpy as jnp
    config = CONFIGS["encoder-hd32"]
    T, base, x, mask, params = _jax_case(config, 1, 0.0)
    prepared = T.prepare_weights(params, T.MIXED_FP16)
    loss = jax.jit(lambda p, h: jnp.square(T.forward(p, h, config=config)).mean())
    d_prepared = jax.grad(loss)(prepared, jnp.asarray(x.numpy()))
    assert isinstance(d_prepared, T.PreparedWeights)
    leaves = jax.tree.leaves(d_prepared)
    assert leaves and all(bool(jnp.isfinite(leaf).all()) for leaf in leaves)
    assert any(float(jnp.abs(leaf).max()) > 0 for leaf in leaves)


def test_tiny_cotangents_keep_their_precision():
    """A mean over many elements times a small factor hands down cotangents far below fp16's normal range;
    the backward's fp16 GEMMs must not lose them (the pullback scales them into range)."""
    config = CONFIGS["official-4-cut"]
    base, ours = _models(config, 9)
    x, mask = make_inputs(config, 9)
    x_ref, x_ours = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    weights = torch.randn(x.shape, generator=torch.Generator().manual_seed(9))   # (a plain mean of a
    (((base(x_ref, mask) * weights).mean()) * 1e-4).backward()                   # LayerNorm output has
    (((ours(x_ours, mask) * weights).mean()) * 1e-4).backward()                  # zero gradient)
    assert _rel(x_ours.grad, x_ref.grad) <= MAX_REL_L2
    for (name, p_ref), (_, p_ours) in zip(base.named_parameters(), ours.named_parameters()):
        if not name.endswith("attention.k_proj.bias"):
            assert _rel(p_ours.grad, p_ref.grad) <= MAX_REL_L2, name


def test_the_training_benchmark_runs_and_records_its_fields(tmp_path):
    import json

    from bench import cli
    argv = ["--suite", "train", "--configs", "cpu-2", "--out", str(tmp_path), "--calls", "1", "--rounds", "1",
            "--warmup", "1"]
    assert cli.main(argv) == 0
    [path] = tmp_path.glob("train-*.json")
    record = json.loads(path.read_text())["configs"]["cpu-2"]
    for key in ("eager_ms", "peer_ms", "ttj_ms", "max_rel_grad_err"):
        assert record[key] > 0, key
    assert record["max_rel_grad_err"] <= MAX_REL_L2 and record["peer"]["max_rel_grad_err"] <= MAX_REL_L2


@pytest.mark.interpret
@pytest.mark.parametrize("padding", [0.0, 0.5])
def test_gradients_with_our_flash_backward_kernels(monkeypatch, padding):
    """TTJ_BACKWARD_ATTENTION=flash: the backward's attention through kernels/flash_attention_bwd.py
    (interpreted here), through the bridge and jax.grad alike."""
    monkeypatch.setenv("TTJ_BACKWARD_ATTENTION", "flash")
    config = CONFIGS["encoder-hd32"] if padding else CONFIGS["causal"]
    base, ours = _models(config, 11)
    x, mask = make_inputs(config, 11, padding_ratio=padding)
    _check_gradients(base, ours, x, mask, 11)


def test_an_unknown_backward_attention_is_refused(monkeypatch):
    from ttj_jax import training
    monkeypatch.setenv("TTJ_BACKWARD_ATTENTION", "magic")
    with pytest.raises(ValueError, match="TTJ_BACKWARD_ATTENTION"):
        training.backward_attention()


def test_expert_options_run_without_autograd_and_say_so():
    config = CONFIGS["causal"]
    _, ours = _models(config, 12)
    x, mask = make_inputs(config, 12)
    with pytest.warns(UserWarning, match="without autograd"):
        out = bridge.forward(ours, x, mask, stack="layers")
    assert out.grad_fn is None


def test_backward_attention_choice():
    """cuDNN only where it takes the call (GPU, no mask, a head_dim it supports); our flash kernels for
    masked calls on a GPU and when asked for; XLA's on the CPU."""
    from ttj_jax import planner, training
    from ttj_jax.config import Config
    config = Config(batch_size=1, seq_len=64, d_model=128, num_heads=2, ffn_dim=128, num_layers=1, causal=True)
    kind = training.backward_attention_kind
    assert kind(config, masked=False, on_gpu=True) == "cudnn"
    assert kind(config, masked=True, on_gpu=True) == "flash"
    assert kind(config, masked=False, on_gpu=False) == "xla"
    assert kind(config, masked=True, on_gpu=False, choice="flash") == "flash"
    assert kind(config, masked=False, on_gpu=True, choice="xla") == "xla"
    assert kind(config, masked=True, on_gpu=True, choice="xla") == "xla"
    odd = Config(batch_size=1, seq_len=64, d_model=120, num_heads=3, ffn_dim=128, num_layers=1, causal=True)   # head_dim 40
    assert kind(odd, masked=False, on_gpu=True) == ("cudnn" if 40 in planner.CUDNN_HEAD_DIMS else "flash")


def test_masked_cudnn_switch_gives_masked_calls_cudnn_where_its_lanes_fit(monkeypatch):
    """training.MASKED_CUDNN: a masked call's backward program takes cuDNN's attention with the mask in
    extra lanes (layers.cudnn_attention), up to head_dim 120, masking keys; off, our flash kernels."""
    from ttj_jax import training
    from ttj_jax.config import Config
    config = Config(batch_size=1, seq_len=64, d_model=128, num_heads=2, ffn_dim=128, num_layers=1, causal=False)
    wide = dataclasses.replace(config, d_model=256)                       # head_dim 128: no room for the lanes
    monkeypatch.setattr(training, "MASKED_CUDNN", True)
    assert training.backward_attention_kind(config, masked=True, on_gpu=True) == "cudnn"
    plan = training.backward_plan(config, masked=True, on_gpu=True)
    assert (plan.attention, plan.mask_mode) == ("cudnn", "keys")
    assert training.backward_attention_kind(wide, masked=True, on_gpu=True) == "flash"
    odd = dataclasses.replace(config, d_model=72)                         # head_dim 36: no multiple of 8
    assert training.backward_attention_kind(odd, masked=True, on_gpu=True) == "flash"
    assert training.backward_attention_kind(config, masked=True, on_gpu=False) == "xla"
    monkeypatch.setattr(training, "MASKED_CUDNN", False)
    assert training.backward_attention_kind(config, masked=True, on_gpu=True) == "flash"


def test_an_all_valid_mask_gives_the_mask_free_gradients_from_the_masked_program():
    """pullback reads nothing of the mask: an all-True mask gives the mask-free program's gradients,
    and a padded one zero gradient on padded rows of x, from one compiled program."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ttj_jax import training
    T, base, x, mask, params = _jax_case(CONFIGS["causal"], 2, 0.5)
    config = T.model_key(T.Config(**vars(CONFIGS["causal"])))
    xj = jnp.asarray(x.numpy())
    g = jnp.asarray(np.random.default_rng(0).standard_normal(x.shape), jnp.float32)
    program = jax.jit(lambda p, h, m, c: training.pullback(p, h, m, c, config=config, on_gpu=False))
    all_valid = jnp.ones(x.shape[:2], bool)
    d_none = program(params, xj, None, g)
    d_all = program(params, xj, all_valid, g)
    for a, b in zip(jax.tree.leaves(d_none), jax.tree.leaves(d_all)):   # the same program, up to fusion
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 1e-4 * max(np.linalg.norm(b), 1e-30)
    padded = jnp.asarray(mask.numpy())
    assert not bool(padded.all())
    _, d_x = program(params, xj, padded, g)
    assert not np.asarray(d_x)[~np.asarray(padded)].any()
    assert np.asarray(d_x)[np.asarray(padded)].any()


def test_eager_residuals_are_released_by_the_backward_and_a_second_backward_recomputes():
    """An eager call in grad mode on a module in training mode keeps the forward's residuals only until
    its backward: afterwards the graph node holds none. retain_graph=True and a second backward give the
    same gradients (recomputed). In eval mode nothing is kept and the backward recomputes, alike."""
    config = CONFIGS["causal"]
    base, ours = _models(config, 4)
    x, mask = make_inputs(config, 1238, padding_ratio=0.5)
    x = x.requires_grad_(True)
    out = ours(x, mask)
    assert out.grad_fn.pull is not None
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    (out * weights).sum().backward(retain_graph=True)
    assert out.grad_fn.pull is None
    first = x.grad.clone()
    x.grad = None
    (out * weights).sum().backward()
    assert _rel(x.grad, first) <= 1e-3
    ours.eval()
    x.grad = None
    out = ours(x, mask)
    assert out.grad_fn.pull is None
    (out * weights).sum().backward()
    assert _rel(x.grad, first) <= 1e-3


def test_training_forward_keeps_parameter_views_that_see_in_place_updates():
    """A module in training mode reads its parameters through kept zero-copy views: the same arrays on
    the next call, sharing the parameters' memory, so an optimizer's in-place update is seen; new memory
    (load into a new tensor) gives new views."""
    from bridge import runtime
    config = CONFIGS["causal"]
    base, ours = _models(config, 9)
    x, mask = make_inputs(config, 9)
    ours(x, mask)
    _, params, tree = runtime.training_parameters(ours)
    views = runtime.module_state(ours).training_views()
    assert tree is not None and views is not None and len(views) == len(params)
    assert all(v.unsafe_buffer_pointer() == p.data_ptr() for v, p in zip(views, params))
    with torch.no_grad():
        for model in (base, ours):
            model.layers[0].ffn_out.weight.mul_(-2.0)
            model.final_norm.bias.add_(0.5)
    out = ours(x, mask)
    assert runtime.training_parameters(ours)[2] is tree           # kept, views and pytree
    assert runtime.module_state(ours).training_views() is views
    assert torch.allclose(out.detach(), base(x, mask).detach(), atol=2e-3, rtol=2e-2)
    ours.final_norm.bias.data = ours.final_norm.bias.detach().clone()   # new memory, same Parameter
    assert runtime.training_parameters(ours)[2] is not tree


@pytest.mark.parametrize("read", ["device", "host"])
def test_the_training_forward_reads_the_mask_on_the_host_only_when_told(monkeypatch, read):
    """TTJ_TRAINING_MASK: by default nothing of the mask is read on the host (no sync); "host" reads
    mask.all() to drop an all-True mask. The gradients match the baseline's either way."""
    from bridge import autograd
    monkeypatch.setenv(autograd.TRAINING_MASK_ENV, read)
    config = CONFIGS["causal"]
    base, ours = _models(config, 0)
    ours.train()
    x, mask = make_inputs(config, 3)
    reads = []
    real_all = torch.Tensor.all
    monkeypatch.setattr(torch.Tensor, "all", lambda t, *a, **k: reads.append(t.dtype) or real_all(t, *a, **k))
    weights = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))   # (a plain sum's dL/dx is ~0)
    x_ours = x.clone().requires_grad_(True)
    (ours(x_ours, mask) * weights).sum().backward()
    monkeypatch.setattr(torch.Tensor, "all", real_all)
    assert (torch.bool in reads) == (read == "host")
    x_base = x.clone().requires_grad_(True)
    (base(x_base, mask) * weights).sum().backward()
    assert float((x_ours.grad - x_base.grad).norm() / x_base.grad.norm()) < MAX_REL_L2


def test_an_unknown_training_mask_read_is_refused(monkeypatch):
    from bridge import autograd
    monkeypatch.setenv(autograd.TRAINING_MASK_ENV, "sometimes")
    with pytest.raises(ValueError, match="TTJ_TRAINING_MASK"):
        autograd.training_mask_read()


def test_the_gradients_policy_runs_its_backward_gemms_in_fp16():
    """mixed_fp16_train: every dot of the backward takes fp16 operands (not an fp32 cotangent against
    an fp16 weight, which ran as TF32 GEMMs on the GPU); dx and dw come back in x's and w's dtypes, near
    the exact gradients; the GELU's backward matches jax's own rule."""
    import jax
    import jax.numpy as jnp

    from ttj_jax.numerics import MIXED_FP16_TRAIN, _gelu_saving_its_input, gelu_exact
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (2, 8, 32), jnp.float32)
    w = jax.random.normal(kw, (32, 16), jnp.float32) / 32 ** 0.5
    g = jax.random.normal(kg, (2, 8, 16), jnp.float32)
    _, pull = jax.vjp(MIXED_FP16_TRAIN.matmul, x, w)
    dx, dw = pull(g)
    assert dx.dtype == jnp.float32 and dw.dtype == jnp.float32
    exact_dx, exact_dw = g @ w.T, jnp.einsum("bsk,bsn->kn", x, g)
    assert float(jnp.linalg.norm(dx - exact_dx) / jnp.linalg.norm(exact_dx)) < 2e-3
    assert float(jnp.linalg.norm(dw - exact_dw) / jnp.linalg.norm(exact_dw)) < 2e-3
    backward = jax.make_jaxpr(lambda x, w, g: jax.vjp(MIXED_FP16_TRAIN.matmul, x, w)[1](g))(x, w, g)

    def dot_eqns(jaxpr):   # every dot_general, nested jaxprs (the custom_vjp's) included
        for e in jaxpr.eqns:
            if e.primitive.name == "dot_general":
                yield e
            for param in e.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    yield from dot_eqns(inner)
    dots = list(dot_eqns(backward.jaxpr))
    assert len(dots) >= 3 and all(v.aval.dtype == jnp.float16 for e in dots for v in e.invars)
    h = jnp.linspace(-6.0, 6.0, 257)
    ours = jax.vmap(jax.grad(_gelu_saving_its_input))(h)
    assert float(jnp.abs(ours - jax.vmap(jax.grad(gelu_exact))(h)).max()) < 1e-6


def test_the_backward_hands_all_parameter_gradients_over_in_one_export(monkeypatch):
    """Each export from jax to torch costs host time (~15-35 us): a training backward makes two (dL/dx and
    one flat vector of every parameter's gradient), however many parameters, and each parameter's
    gradient is its own region of that vector."""
    from bridge.transfer import Transfer
    config = CONFIGS["official-4-cut"]
    base, ours = _models(config, 0)
    ours.train()
    x, mask = make_inputs(config, 5, padding_ratio=0.5)
    out = ours(x.clone().requires_grad_(True), mask)
    exports = []
    real = Transfer.to_torch
    monkeypatch.setattr(Transfer, "to_torch", lambda self, a: exports.append(a.shape) or real(self, a))
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
    assert len(exports) == 2
    grads = [p.grad for p in ours.parameters() if p.grad is not None and torch.count_nonzero(p.grad)]
    assert len(grads) == len(list(ours.parameters())) - config.num_layers   # all but the key biases (zeros)
    starts = sorted(g.data_ptr() for g in grads)
    assert len(set(starts)) == len(grads)


@pytest.mark.parametrize("padding", [0.0, 0.5])
def test_the_training_forward_meets_the_harness_rule(padding):
    """A module in training mode returns the gradients' program's output (policy mixed_fp16_train, with
    q/k/v and the MLP's pre-activation stored in fp16): it meets the harness rule as inference does."""
    from bench.baseline import check_close
    config = CONFIGS["official-4-cut"]
    base, ours = _models(config, 4)
    ours.train()
    x, mask = make_inputs(config, 6, padding_ratio=padding)
    y = ours(x.clone().requires_grad_(True), mask)
    assert y.grad_fn is not None
    with torch.no_grad():
        failed, worst = check_close(y.detach().double(), base(x, mask).double())
    assert failed == 0 and worst < 0.8


def test_masked_cudnn_training_program_gives_the_xla_programs_gradients(monkeypatch, cudnn_on_cpu):
    """The backward program with cuDNN's lane-masked attention (training.MASKED_CUDNN, as on a GPU; cuDNN's
    call runs as jax's own attention here) against the CPU's XLA-attention program: the same y and the
    same gradients of x and every parameter, for a mask with holes and a sequence with no valid token."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ttj_jax import training
    from ttj_jax.config import Config
    from ttj_jax.params import init_params
    monkeypatch.setattr(training, "MASKED_CUDNN", True)
    config = Config(batch_size=3, seq_len=24, d_model=32, num_heads=2, ffn_dim=64, num_layers=2, causal=False)
    keys = jax.random.split(jax.random.PRNGKey(5), 3)
    params = init_params(keys[0], config)
    mask = jnp.asarray(make_mask("all_invalid", 3, 24, seed=7).numpy())
    x = jax.random.normal(keys[1], (3, 24, 32)) * mask[:, :, None]
    g = jax.random.normal(keys[2], x.shape) / x.size
    out = {}
    for on_gpu in (True, False):
        y, pull = training.forward_with_pullback(params, x, mask, config=config, on_gpu=on_gpu)
        out[on_gpu] = (y, *training.apply_pullback(pull, g))
    assert cudnn_on_cpu and all(shape[-1] == 16 + 8 for call in cudnn_on_cpu for shape in call)
    got, want = (jax.tree.leaves(out[k]) for k in (True, False))
    assert len(got) == len(want)
    # (the key bias's gradient is zero in exact arithmetic, rounding noise in both: the floor)
    floor = 1e-4 * max(np.linalg.norm(np.asarray(b, np.float64)) for b in want[1:])
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.isfinite(a).all()
        assert np.linalg.norm(a - b) <= 5e-3 * np.linalg.norm(b) + floor


@pytest.mark.parametrize("masked", [False, True])
def test_the_training_forward_returns_none_of_its_inputs_and_the_same_gradients(masked):
    """The bridge's training forward (bridge.autograd.forward_program) leaves out of its outputs the
    residuals that are its own inputs (a copy each: the fp32 x the first LayerNorm keeps, the LayerNorms'
    parameters, the mask), and its backward, given them back, computes what the whole pullback does."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bridge.autograd import apply_program, flat_gradients, forward_program
    from ttj_jax import training
    from ttj_jax.config import Config
    from ttj_jax.params import init_params
    from ttj_jax.programs import model_key
    config = Config(batch_size=2, seq_len=16, d_model=32, num_heads=2, ffn_dim=64, num_layers=2, causal=True)
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    params = init_params(keys[0], config)
    x = jax.random.normal(keys[1], (2, 16, 32))
    mask = jnp.asarray(make_mask("prefix", 2, 16, seed=1).numpy()) if masked else None
    g = jax.random.normal(keys[2], x.shape) / x.size
    inputs = (params, x, mask)
    forward = forward_program(model_key(config), False, "auto")
    y, residuals = forward(*inputs)
    input_leaves = jax.tree.leaves(inputs)
    # x and the 10 LayerNorm parameters (2 per LayerNorm, 2 LayerNorms a layer and the final one); the
    # flash attention's programs keep the mask too (on the CPU XLA's attention keeps a broadcast of it)
    assert len(residuals.needed) >= 1 + 2 * (2 * config.num_layers + 1)
    assert any(input_leaves[i] is x for i in residuals.needed)
    jaxpr = jax.make_jaxpr(forward)(*inputs).jaxpr.eqns[0].params["jaxpr"].jaxpr
    assert not set(map(id, jaxpr.outvars)) & set(map(id, jaxpr.invars))
    flat, d_x = apply_program(model_key(config))(residuals, residuals.forwarded(inputs), g)

    @jax.jit
    def whole(params, x, mask, g):   # the pullback returned whole, as one program
        y, pull = training.forward_with_pullback(params, x, mask, config=config, on_gpu=False)
        return y, *training.apply_pullback(pull, g)
    y_whole, d_params, d_x_whole = whole(params, x, mask, g)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_whole), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(d_x), np.asarray(d_x_whole), rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(np.asarray(flat), np.asarray(flat_gradients(d_params, config)), rtol=1e-5, atol=1e-9)
