"""The PyTorch bridge on the CPU: parameter names, zero-copy weights, cache invalidation, dtypes,
devices, the harness flow end to end in both plug-in ways, and bad inputs. (The CUDA path, with its
stream ordering, is exercised on the H200 by `ttj-bench --suite official`.)"""

import copy
import dataclasses

import numpy as np
import pytest
import torch
from conftest import make_mask, random_input, torch_reference

import bridge
import ttj_jax as T
from bench.baseline import BaselineTransformer, TransformerConfig, copy_model_weights, make_inputs
from bridge import runtime, settings
from bridge import transfer as bt
from ttj_jax import planner

CONFIG = TransformerConfig(batch_size=2, seq_len=17, d_model=64, num_heads=4, ffn_dim=96, num_layers=2,
                           causal=True)


def pair(config=CONFIG, seed=0):
    torch.manual_seed(seed)
    base = BaselineTransformer(config).eval()
    ours = bridge.TTJTransformer(config).eval()
    copy_model_weights(base, ours, strict=True)
    return base, ours


def test_parameter_names_and_shapes_match_the_harness_both_ways():
    base, ours = pair()
    assert list(ours.state_dict()) == list(base.state_dict())
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in base.state_dict().items()}
    assert set(ours.state_dict()) == set(T.expected_shapes(T.Config.from_object(CONFIG)))
    copy_model_weights(ours, base, strict=True)       # and back
    assert bridge.UserOptimizedTransformer is bridge.TTJTransformer


def test_default_init_is_pytorchs():
    torch.manual_seed(0)
    ours = bridge.TTJTransformer(CONFIG)
    w = ours.layers[0].ffn_out.weight
    bound = 1 / np.sqrt(CONFIG.ffn_dim)
    assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound
    assert (ours.final_norm.weight == 1).all() and (ours.final_norm.bias == 0).all()


def test_weights_reach_jax_zero_copy():
    base, ours = pair()
    x, _ = make_inputs(CONFIG, 1)
    with torch.no_grad():   # (in grad mode a module in training mode runs the training forward)
        ours(x)
    views = bridge.weight_views(ours)
    assert len(views) == len(list(ours.parameters()))
    for name, p in ours.named_parameters():
        assert views[name].unsafe_buffer_pointer() == p.data_ptr(), name


def test_matches_reference_and_never_modifies_inputs(harness_rule):
    base, ours = pair()
    x, mask = make_inputs(CONFIG, 5, padding_ratio=0.4)
    x_before, mask_before = x.clone(), mask.clone()
    y = ours(x, mask)
    assert torch.equal(x, x_before) and torch.equal(mask, mask_before)
    assert y.dtype == x.dtype and y.shape == x.shape and y.device == x.device
    harness_rule(y, torch_reference(base, x, mask))
    assert y.data_ptr() != x.data_ptr()


def _stale_check(change, harness_rule):
    """Runs once, applies `change(base, ours)`, and checks the next output follows the new weights."""
    base, ours = pair()
    x, _ = make_inputs(CONFIG, 2)
    before = ours(x)
    change(base, ours)
    after = ours(x)
    assert not torch.equal(before, after), "output unchanged: stale weights were used"
    fresh = bridge.TTJTransformer(CONFIG).eval()
    copy_model_weights(ours, fresh)                  # a fresh module (fresh cache) with the new weights
    assert torch.equal(after, fresh(x))
    harness_rule(after, torch_reference(base, x, None))


def test_in_place_parameter_edit_is_seen(harness_rule):
    def change(base, ours):
        with torch.no_grad():
            for m in (base, ours):
                m.layers[1].ffn_in.weight.mul_(1.5)
                m.final_norm.bias.add_(0.25)
    _stale_check(change, harness_rule)


def test_load_state_dict_is_seen(harness_rule):
    def change(base, ours):
        torch.manual_seed(123)
        other = BaselineTransformer(CONFIG)
        base.load_state_dict(other.state_dict())
        copy_model_weights(other, ours)
    _stale_check(change, harness_rule)


def test_dtype_change_with_to_is_seen(harness_rule):
    def change(base, ours):
        ours.to(dtype=torch.float16)                       # weights rounded to fp16 ...
        base.load_state_dict({k: v.half().float() for k, v in base.state_dict().items()})
        ours.to(dtype=torch.float32)                       # ... and back: same dtype, new storage
    _stale_check(change, harness_rule)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("grad_mode", ["inference_mode", "no_grad", "enabled"])
def test_dtypes_and_grad_modes(dtype, grad_mode, harness_rule):
    base, ours = pair()
    x = random_input(T.Config.from_object(CONFIG), 3).to(dtype)
    if grad_mode == "enabled":
        x.requires_grad_(dtype.is_floating_point)
    context = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}.get(grad_mode)
    with (context() if context else torch.enable_grad()):
        y = ours(x)
    assert y.dtype == dtype and y.shape == x.shape
    harness_rule(y.float(), torch_reference(base, x.detach().float(), None))


def test_non_contiguous_input(harness_rule):
    base, ours = pair()
    x = random_input(T.Config.from_object(CONFIG), 4, batch=CONFIG.seq_len, seq_len=2).transpose(0, 1)
    assert not x.is_contiguous()
    harness_rule(ours(x), torch_reference(base, x.contiguous(), None))


def test_mask_edited_in_place_is_reclassified(harness_rule):
    base, ours = pair(CONFIG.__class__(**{**vars(CONFIG), "causal": False}))
    x, mask = make_inputs(base.config, 6)
    ours(x, mask)                                        # all True: cached as such
    mask[0, 3] = False                                   # now a general mask, same tensor object
    harness_rule(ours(x, mask), torch_reference(base, x, mask))


def test_inference_tensor_masks_are_read_every_call_on_the_host_and_decided_on_the_device_elsewhere(harness_rule):
    base, ours = pair()
    with torch.inference_mode():
        x = random_input(T.Config.from_object(CONFIG), 8)
        mask = make_mask("random", CONFIG.batch_size, CONFIG.seq_len, seed=8).clone()
        assert mask.is_inference()
        assert "mask-keys" in bridge.explain(ours, x, mask)   # a host mask: read, so classified exactly
        harness_rule(ours(x, mask), torch_reference(base, x, mask))
        mask[:] = True                                   # edited in place, no version counter to see it
        harness_rule(ours(x, mask), torch_reference(base, x, mask))
        assert "mask-none" in bridge.explain(ours, x, mask)
        # a device mask without a version counter is not read on the host (a sync): the device decides
        on_device = torch.ones(2, 3, dtype=torch.bool, device="meta")
        assert runtime.module_state(ours).classify(on_device) == T.MaskKind.UNKNOWN


def test_TTJ_GPU_MASK_choices(monkeypatch):
    for value, expected in (("device", "device"), ("host", "host"), ("auto", "auto"), ("", "auto")):
        monkeypatch.setenv(settings.GPU_MASK_ENV, value)
        assert settings.gpu_mask_mode() == expected
    monkeypatch.setenv(settings.GPU_MASK_ENV, "sometimes")
    with pytest.raises(ValueError, match="TTJ_GPU_MASK"):
        settings.gpu_mask_mode()


@pytest.mark.parametrize("mode", ["auto", "device", "host"])
def test_how_each_TTJ_GPU_MASK_finds_a_gpu_masks_kind(monkeypatch, mode):
    """A GPU mask (a meta tensor stands in: any device but the CPU; its host reads are counted, not done):
    "device" never reads it; "auto" reads it on every call, the same tensor at the same version included,
    where the call's work is at least HOST_MASK_READ_MIN_FLOP, and never below; "host" reads it once per
    tensor and version. A host mask is read on every call in every mode (no sync to save)."""
    monkeypatch.setenv(settings.GPU_MASK_ENV, mode)
    base, ours = pair()
    x, mask = make_inputs(CONFIG, 5)
    ours(x, mask)
    state = runtime.module_state(ours)
    assert state.mask_on_device is (mode != "host")
    reads = []
    monkeypatch.setattr(runtime, "read_mask_kind", lambda m: reads.append(m) or T.MaskKind.PREFIX)
    on_device = torch.ones(2, 3, dtype=torch.bool, device="meta")
    assert not on_device.is_inference()
    small = [state.classify(on_device) for _ in range(2)]
    monkeypatch.setattr(planner, "HOST_MASK_READ_MIN_FLOP", 0.0)   # every call now counts as large
    large = [state.classify(on_device) for _ in range(2)]
    on_device.fill_(True)   # a new version
    large.append(state.classify(on_device))
    unknown, prefix = T.MaskKind.UNKNOWN, T.MaskKind.PREFIX
    if mode == "device":
        assert small + large == [unknown] * 5 and reads == []
        assert "decided on the device" in state.mask_reading(on_device)
    elif mode == "auto":
        assert small == [unknown] * 2 and large == [prefix] * 3 and len(reads) == 3
        assert "read on the host on every call" in state.mask_reading(on_device)
    else:
        assert small + large == [prefix] * 5 and len(reads) == 2   # the first call and the new version
        assert "once per tensor and version" in state.mask_reading(on_device)
    assert state.classify(mask) == T.MaskKind.ALL_TRUE and state.mask_reading(mask) == ""   # the host mask: read


def test_auto_mask_reading_covers_only_long_calls():
    """The official shapes 1-13 (10-1300 us on an H100) leave the mask to the device; shape 14 (2.9 s)
    reads it. The FLOP count is the spec's (1.39 PFLOP at shape 14)."""
    for shape_id, shape in T.OFFICIAL.items():
        config = shape.config
        assert planner.reads_gpu_mask_on_host(config, config.batch_size, config.seq_len) is (shape_id == "14")
    fourteen = T.OFFICIAL["14"].config
    assert planner.forward_flop(fourteen, fourteen.batch_size, fourteen.seq_len) == pytest.approx(1.39e15, rel=0.01)
    non_causal = dataclasses.replace(fourteen, causal=False)
    assert planner.forward_flop(non_causal, 1, 1000) > planner.forward_flop(fourteen, 1, 1000)


def test_harness_flow_assigning_our_class(harness_rule):
    """The harness (docs/spec.md), way (a): our module assigned as UserOptimizedTransformer, weights copied strictly,
    `.to(device, dtype).eval()`, five seeds under inference_mode, every element checked."""
    UserOptimizedTransformer = bridge.UserOptimizedTransformer
    for padding_ratio in (0.0, 0.3):
        baseline = BaselineTransformer(CONFIG)
        optimized = UserOptimizedTransformer(CONFIG)
        copy_model_weights(baseline, optimized, strict=True)
        baseline = baseline.to(device="cpu", dtype=torch.float32).eval()
        optimized = optimized.to(device="cpu", dtype=torch.float32).eval()
        with torch.inference_mode():
            for seed in range(1234, 1239):
                x, mask = make_inputs(CONFIG, seed, padding_ratio=padding_ratio)
                harness_rule(optimized(x, mask), baseline(x, mask), label=f"-p{padding_ratio}-s{seed}")


def test_harness_flow_one_line_drop_in(harness_rule):
    """Way (b): one line in the "your codes here" block, on self's own baseline-structured parameters."""
    class UserOptimizedTransformer(BaselineTransformer):
        def forward(self, x, valid_token_mask=None):
            # --- your codes here ---
            return bridge.forward(self, x, valid_token_mask)

    baseline = BaselineTransformer(CONFIG)
    optimized = UserOptimizedTransformer(CONFIG)
    copy_model_weights(baseline, optimized, strict=True)
    baseline, optimized = baseline.eval(), optimized.eval()
    with torch.inference_mode():
        for seed in range(1234, 1239):
            x, mask = make_inputs(CONFIG, seed)
            harness_rule(optimized(x, mask), baseline(x, mask), label=f"-s{seed}")


def test_deepcopy_and_state_dict_do_not_carry_the_cache():
    base, ours = pair()
    x, _ = make_inputs(CONFIG, 1)
    ours(x)
    assert list(ours.state_dict()) == list(base.state_dict())
    clone = copy.deepcopy(ours)
    assert torch.equal(clone(x), ours(x))


META = "meta"


@pytest.mark.parametrize("make_bad, error, match", [
    (lambda x, m: (x[0], None), ValueError, "rank 3"),
    (lambda x, m: (x[..., :-1], None), ValueError, "d_model"),
    (lambda x, m: (x, m[:, :-1]), ValueError, r"valid_token_mask must have shape"),
    (lambda x, m: (x, m.int()), TypeError, "valid_token_mask must be bool"),
    (lambda x, m: (x.int(), None), TypeError, "floating point"),
    (lambda x, m: (x.numpy(), None), TypeError, "torch.Tensor"),
    (lambda x, m: (x, m.to(META)), ValueError, "valid_token_mask is on meta but x is on cpu"),
    (lambda x, m: (x.to(META), None), ValueError, "x is on meta but the module's weights are on cpu"),
])
def test_bad_inputs_raise_clear_errors(make_bad, error, match):
    _, ours = pair()
    x, mask = make_inputs(CONFIG, 0)
    bad_x, bad_mask = make_bad(x, mask)
    with pytest.raises(error, match=match):
        ours(bad_x, bad_mask)


def test_bad_configs_and_modules():
    with pytest.raises(ValueError, match="divisible by num_heads"):
        bridge.TTJTransformer(TransformerConfig(1, 8, 30, 4, 32, 1, True))
    with pytest.raises(ValueError, match="no `config` attribute"):
        bridge.forward(torch.nn.Linear(4, 4), torch.randn(1, 2, 4))
    with pytest.raises(ValueError, match="lacks parameter"):
        bridge.forward(torch.nn.Linear(4, 4), torch.randn(1, 2, 4), config=CONFIG)


def test_capsule_paths_are_zero_copy_both_ways():
    """The native import of an already-ordered capsule and the native export (the CUDA hot path's
    calls, exercised here on the CPU) share memory with their source."""
    from ttj_jax.compat import dlpack_exporter, dlpack_importer
    t = torch.randn(3, 5)
    importer = dlpack_importer(*t.__dlpack_device__())
    assert importer.fast
    a = importer.from_capsule(torch.utils.dlpack.to_dlpack(t))
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(a), t.numpy())
    back = torch.utils.dlpack.from_dlpack(dlpack_exporter()(a, None))
    assert back.data_ptr() == t.data_ptr() and torch.equal(back, t)


def test_steady_state_no_recompilation_across_shapes():
    """Two models and several input shapes in one process, called in turn: after the first pass nothing
    compiles again. (Host syncs cannot be seen on the CPU backend, where jax's transfer guard does not
    fire; the bridge's absence of them is by construction, see bridge/runtime.py.)"""
    from ttj_jax.compat import count_compilations
    other = TransformerConfig(batch_size=3, seq_len=9, d_model=32, num_heads=2, ffn_dim=32, num_layers=1,
                              causal=True)
    (_, a), (_, b) = pair(), pair(other)
    inputs = [(a, make_inputs(CONFIG, 1)), (b, make_inputs(other, 2)), (a, make_inputs(CONFIG, 3, seq_len=5)),
              (a, make_inputs(CONFIG, 4, padding_ratio=0.5))]
    for module, (x, mask) in inputs:
        module(x, mask)
    with count_compilations() as counter:
        for _ in range(2):
            for module, (x, mask) in inputs:
                module(x, mask)
    assert counter.count == 0, f"{counter.count} compilations in the steady state"


def _only_call(ours):
    from bridge import runtime
    calls = list(runtime._STATES[ours].calls.values())
    assert len(calls) == 1
    return calls[0]


def test_weights_fast_path_drops_old_weights_on_change(harness_rule):
    base, ours = pair()
    x = random_input(T.Config.from_object(CONFIG), 15)
    ours(x)
    call = _only_call(ours)
    before = call.weights
    with torch.no_grad():
        for (_, p), (_, q) in zip(base.named_parameters(), ours.named_parameters()):
            p.mul_(0.9), q.mul_(0.9)
    harness_rule(ours(x), torch_reference(base, x, None))
    assert call.weights is not before


def _fresh_copy_output(ours, x):
    fresh = bridge.TTJTransformer(CONFIG).eval()
    fresh.load_state_dict(ours.state_dict())
    return fresh(x)


@pytest.mark.parametrize("replace", ["parameter", "submodule", "assign_load", "overwrite_conversion"])
def test_replaced_parameter_objects_are_noticed(replace, monkeypatch):
    """Parameters replaced by new objects (not edited in place) since the last call: the versions and
    data pointers the weights are keyed on live on the old objects, which do not change. After each
    replacement the output equals a fresh module's with the same state_dict."""
    _, ours = pair()
    x = random_input(T.Config.from_object(CONFIG), 31)
    first = ours(x)
    generator = torch.Generator().manual_seed(5)

    def new_like(t):
        return torch.randn(t.shape, generator=generator) * 0.05

    if replace == "parameter":
        ours.layers[0].ffn_in.weight = torch.nn.Parameter(new_like(ours.layers[0].ffn_in.weight))
    elif replace == "submodule":
        layer = torch.nn.Linear(CONFIG.d_model, CONFIG.d_model)
        with torch.no_grad():
            layer.weight.copy_(new_like(layer.weight))
        ours.layers[1].attention.q_proj = layer
    elif replace == "assign_load":
        ours.load_state_dict({k: new_like(v) for k, v in ours.state_dict().items()}, assign=True)
    else:   # .to() with torch's flag set: parameters swapped in their dicts, no registration hook fires
        monkeypatch.setattr(torch.__future__, "_overwrite_module_params_on_conversion", True)
        ours.double().float()
        with torch.no_grad():
            ours.layers[0].ffn_in.weight.mul_(2.0)
    second = ours(x)
    assert not torch.equal(second, first)
    assert torch.equal(second, _fresh_copy_output(ours, x))


def test_a_replacement_that_no_longer_fits_raises_on_every_call():
    """A parameter replaced by one of the wrong shape: a clear error, on this call and the next (not the
    old weights silently from the second call on); putting a fitting one back works again."""
    _, ours = pair()
    x = random_input(T.Config.from_object(CONFIG), 34)
    ours(x)
    good = ours.layers[0].ffn_in.weight
    ours.layers[0].ffn_in.weight = torch.nn.Parameter(torch.zeros(3, 3))
    for _ in range(2):
        with pytest.raises(ValueError, match="layers.0.ffn_in.weight has shape"):
            ours(x)
    ours.layers[0].ffn_in.weight = good
    assert torch.equal(ours(x), _fresh_copy_output(ours, x))


def test_steady_calls_do_not_collect_the_parameters_again(monkeypatch):
    """The structure check costs one integer comparison per call while nothing registers a parameter or
    submodule anywhere: no dict walk, no re-collection; one registration anywhere makes the next call
    compare the module's objects (equal here: nothing re-collected)."""
    from bridge import runtime
    _, ours = pair()
    x = random_input(T.Config.from_object(CONFIG), 32)
    ours(x)
    state = runtime._STATES[ours]
    collects, walks = [], []
    monkeypatch.setattr(state, "_collect", lambda module: collects.append(module))
    real_values = runtime._dict_values
    monkeypatch.setattr(runtime, "_dict_values", lambda d: walks.append(1) or real_values(d))
    for _ in range(3):
        ours(x)
    assert walks == [] and collects == []
    torch.nn.Linear(2, 2)   # registers two parameters somewhere else
    ours(x)
    assert walks and collects == []


def test_our_modules_parameters_share_one_version_counter_and_nothing_else():
    """TTJTransformer's parameters report one version counter (an in-place write to any bumps all), and
    stay ordinary parameters: separate storages, no views, the same values as torch's init, the counter
    kept through `.to()`. Copies get new parameter objects, which are read one by one."""
    import pickle

    from bridge.versions import shared_version_counter
    torch.manual_seed(3)
    ours = bridge.TTJTransformer(CONFIG)
    torch.manual_seed(3)
    plain = BaselineTransformer(CONFIG)
    params = list(ours.parameters())
    assert shared_version_counter(params)
    assert len({p.data_ptr() for p in params}) == len(params)
    assert not any(p._is_view() or p._base is not None for p in params)
    assert all(p.requires_grad and type(p) is torch.nn.Parameter for p in params)
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), plain.state_dict().values()))
    ours.to(torch.float64)
    params = list(ours.parameters())
    assert shared_version_counter(params) and params[0].dtype == torch.float64
    copies = [copy.deepcopy(ours), pickle.loads(pickle.dumps(ours))]
    before = [[p._version for p in c.parameters()] for c in copies]
    with torch.no_grad():
        ours.final_norm.bias.add_(1.0)
    assert len({p._version for p in params}) == 1 and params[0]._version > 0
    assert [[p._version for p in c.parameters()] for c in copies] == before
    assert not any(shared_version_counter(list(c.parameters())) for c in copies)
    assert not shared_version_counter(list(BaselineTransformer(CONFIG).parameters()))


@pytest.mark.parametrize("module", ["ours", "deep_copy", "harness_module"])
def test_an_in_place_edit_of_any_one_parameter_is_seen(module, harness_rule):
    """Whichever way the parameters are watched (one shared version, or one version each for a copy and
    for the harness's own module in the drop-in way), an in-place edit of one parameter, the first or the
    last, changes the next output to the new weights'."""
    base, ours = pair()
    if module == "deep_copy":
        ours = copy.deepcopy(ours)
    x = random_input(T.Config.from_object(CONFIG), 36)

    def run():
        if module == "harness_module":
            return bridge.forward(other, x)
        return ours(x)
    other = copy.deepcopy(base)
    for name in ("layers.0.norm1.weight", "final_norm.bias"):
        first = run()
        with torch.no_grad():
            for m in (base, ours, other):
                m.get_parameter(name).mul_(1.5).add_(0.125)
        second = run()
        assert not torch.equal(second, first), name
        harness_rule(second, torch_reference(base, x, None), f"-{module}-{name}")
    state = runtime.module_state(other if module == "harness_module" else ours)
    assert state.watch.shared == (module == "ours")


@pytest.mark.parametrize("made", ["built", "copied"])
def test_parameters_that_are_inference_tensors_run_and_say_what_is_not_seen(made, harness_rule):
    """A module built, or deep-copied, under torch.inference_mode has parameters without a version
    counter: the call runs (one warning names what it cannot see), and `.to()` and `.data =` are still
    seen."""
    base, ours = pair()
    x = random_input(T.Config.from_object(CONFIG), 38)
    with torch.inference_mode():
        if made == "built":
            ours = bridge.TTJTransformer(CONFIG).eval()
            ours.load_state_dict(base.state_dict())
        else:
            ours = copy.deepcopy(ours)
        assert ours.layers[0].ffn_in.weight.is_inference()
        with pytest.warns(UserWarning, match="inference tensors"):
            first = ours(x)
        harness_rule(first, torch_reference(base, x, None))
        ours.to(torch.float32)
        with torch.no_grad():
            base.layers[0].ffn_in.weight.mul_(0.5)
        ours.layers[0].ffn_in.weight.data = base.layers[0].ffn_in.weight.detach().clone()
        second = ours(x)
    assert not torch.equal(second, first)
    harness_rule(second, torch_reference(base, x, None), "-after")


def test_torchs_pointer_comparison_is_used_only_if_it_answers_right(monkeypatch):
    from bridge import versions
    monkeypatch.delattr(torch._C, "_tensors_data_ptrs_at_indices_equal", raising=False)
    assert versions._checked_bulk_pointers_equal() is None
    for wrong in (lambda tensors, pointers, indices: True, lambda tensors, pointers: True):
        monkeypatch.setattr(torch._C, "_tensors_data_ptrs_at_indices_equal", wrong, raising=False)
        assert versions._checked_bulk_pointers_equal() is None

    def right(tensors, pointers, indices):
        return all(tensors[i].data_ptr() == pointers[i] for i in indices)
    monkeypatch.setattr(torch._C, "_tensors_data_ptrs_at_indices_equal", right, raising=False)
    assert versions._checked_bulk_pointers_equal() is right


def test_data_pointers_are_compared_in_one_call_where_torch_has_one(monkeypatch):
    """Where torch has its C comparison of data pointers (CUDA builds), the watch calls it once per check
    instead of reading each pointer; a `.data =` reassignment is still caught through it."""
    from bridge import versions
    calls = []

    def bulk(tensors, pointers, indices):
        calls.append(len(indices))
        return all(tensors[i].data_ptr() == pointers[i] for i in indices)
    monkeypatch.setattr(versions, "_bulk_pointers_equal", bulk)
    _, ours = pair()
    x = random_input(T.Config.from_object(CONFIG), 37)
    first = ours(x)
    calls.clear()
    assert torch.equal(ours(x), first)
    assert calls == [len(list(ours.parameters()))]
    weight = ours.layers[1].ffn_out.weight
    weight.data = weight.data.clone() * 0.5
    second = ours(x)
    assert not torch.equal(second, first)
    assert torch.equal(second, _fresh_copy_output(ours, x))


def test_data_attribute_reassignment_is_noticed():
    """`.data =` keeps the parameter object and its version but moves its storage: the data pointers in
    the weights key catch it (`.to()` on a module does this to every parameter)."""
    _, ours = pair()
    x = random_input(T.Config.from_object(CONFIG), 33)
    first = ours(x)
    weight = ours.layers[0].ffn_in.weight
    version = weight._version
    weight.data = weight.data.clone() * 0.5
    assert weight._version == version
    second = ours(x)
    assert not torch.equal(second, first)
    assert torch.equal(second, _fresh_copy_output(ours, x))


def test_driver_ordering_records_on_torchs_stream_then_waits_on_jaxs(monkeypatch):
    """The CUDA ordering of bridge.transfer._driver_ordering, with a fake driver (no GPU in CI; the GPU check is
    bench.host_overhead's ordering check):
    one event made once, then per call cuEventRecord on torch's current raw stream and cuStreamWaitEvent
    of jax's stream on that event, in that order; False (so the caller falls back to torch's wrappers)
    when the driver refuses either, or when another device is current (handle 0, torch's default
    stream, would then name that device's stream); None when the driver is missing."""
    import ctypes


    calls = []

    class FakeFunction:
        def __init__(self, name, result=0):
            self.name, self.result, self.argtypes = name, result, None

        def __call__(self, *args):
            if self.name == "cuEventCreate":
                ctypes.cast(args[0], ctypes.POINTER(ctypes.c_void_p))[0] = 0xE1
            calls.append((self.name,) + (() if self.name == "cuEventCreate" else tuple(getattr(a, "value", a) for a in args)))
            return self.result

    class FakeDriver:
        def __init__(self):
            self.cuEventCreate = FakeFunction("cuEventCreate")
            self.cuEventRecord = FakeFunction("cuEventRecord")
            self.cuStreamWaitEvent = FakeFunction("cuStreamWaitEvent")

    fake = FakeDriver()
    monkeypatch.setattr(bt, "_libcuda", lambda: fake)
    monkeypatch.setattr(torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: None)
    current = [3]
    monkeypatch.setattr(bt, "current_cuda_device", lambda: current[0])
    order = bt._driver_ordering(torch.device("cuda", 3), lambda: 0x5A, (0x7B,))
    assert order is not None and [c[0] for c in calls] == ["cuEventCreate"]
    calls.clear()
    assert order() is True
    assert calls == [("cuEventRecord", 0xE1, 0x5A), ("cuStreamWaitEvent", 0x7B, 0xE1, 0)]
    calls.clear()
    # jax's compute stream waits on the same event too (one record, one wait per stream)
    both = bt._driver_ordering(torch.device("cuda", 3), lambda: 0x5A, (0x7B, 0x7C))
    calls.clear()
    assert both() is True
    assert calls == [("cuEventRecord", 0xE1, 0x5A), ("cuStreamWaitEvent", 0x7B, 0xE1, 0),
                     ("cuStreamWaitEvent", 0x7C, 0xE1, 0)]
    calls.clear()
    current[0] = 0                                   # another GPU current: torch's wrappers do it
    assert order() is False and calls == []
    current[0] = 3
    fake.cuStreamWaitEvent.result = 1                # the driver refuses the wait
    assert order() is False
    monkeypatch.setattr(bt, "_libcuda", lambda: (_ for _ in ()).throw(OSError("no libcuda")))
    assert bt._driver_ordering(torch.device("cuda", 3), lambda: 0, (0x7B,)) is None


def test_kept_import_is_reused_only_for_the_same_tensor_memory_and_layout():
    """Transfer.to_jax_kept's cache: the same tensor object with the same data pointer,
    shape, strides and dtype gets the kept array (its contents may change: the compute-stream wait
    orders those writes); anything else is imported anew and kept instead."""
    kept = bt.KeptImport()
    loads = []

    def load(t):
        loads.append(t)
        return ("array", len(loads))

    x = torch.zeros(4, 6)
    first = kept.get(x, load)
    assert kept.get(x, load) is first and len(loads) == 1
    x.add_(1.0)                                      # contents change in place: still the same import
    assert kept.get(x, load) is first and len(loads) == 1
    y = torch.zeros(4, 6)                            # another tensor, same shape
    assert kept.get(y, load) == ("array", 2)
    assert kept.get(x, load) == ("array", 3)         # one kept at a time: x is imported again
    x.data = torch.ones(4, 6)                        # same object, new memory
    assert kept.get(x, load) == ("array", 4)
    x.resize_(6, 4)                                  # same object and memory, another layout
    assert kept.get(x, load) == ("array", 5)
    assert kept.get(x.t(), load) == ("array", 6)     # a view is another tensor object
    failing = torch.zeros(2)
    with pytest.raises(RuntimeError):
        kept.get(failing, lambda t: (_ for _ in ()).throw(RuntimeError("import failed")))
    assert kept.tensor is None and kept.array is None   # nothing half-kept after a failed import


def test_no_kept_import_without_a_compute_stream_handle():
    """On the CPU jax's buffer_callback has no GPU context, so there is no compute stream to order and
    the bridge's transfer never reports one (every call imports x afresh)."""
    import jax

    from ttj_jax.compat import jax_compute_stream
    assert jax_compute_stream(jax.devices("cpu")[0]) is None
    transfer = bt.transfer_for(torch.device("cpu"))
    assert transfer.compute_stream is None and transfer.order_before_jax() is False


def test_keep_x_import_is_on_unless_turned_off(monkeypatch):
    """On by default; the environment variable turns it off."""
    from bridge import settings
    monkeypatch.delenv(settings.KEEP_X_IMPORT_ENV, raising=False)
    assert settings.keep_x_import() is True
    for value, expected in (("1", True), ("0", False), ("", False), ("false", False)):
        monkeypatch.setenv(settings.KEEP_X_IMPORT_ENV, value)
        assert settings.keep_x_import() is expected


def test_order_programs_waits_on_the_compute_stream_alone_else_falls_back(monkeypatch):
    """order_programs (forward's single-device path): the compute stream's wait alone when its handle
    is known and the driver took it; else order_before_jax's full ordering (and its answer)."""
    transfer = bt.transfer_for(torch.device("cpu"))
    full = []
    monkeypatch.setattr(transfer, "order_before_jax", lambda: full.append(1) or False)
    monkeypatch.setattr(transfer, "order_compute", lambda: True)
    assert transfer.order_programs() is True and full == []
    monkeypatch.setattr(transfer, "order_compute", lambda: False)   # e.g. another device current
    assert transfer.order_programs() is False and full == [1]
    monkeypatch.setattr(transfer, "order_compute", None)              # no compute-stream handle
    assert transfer.order_programs() is False and full == [1, 1]


def test_forward_keeps_x_import_only_when_the_compute_stream_waited(monkeypatch, harness_rule):
    """forward's use of the kept import: when order_programs() says jax's compute stream
    waited (faked here: the CPU has no such stream), x is imported once and reused while it is the same
    tensor; another tensor is imported anew; when it says no, every call imports afresh."""
    base, ours = pair()
    x = random_input(T.Config.from_object(CONFIG), 21)
    ours(x)
    transfer = _only_call(ours).transfer
    imports = []
    real_to_jax = transfer.to_jax
    monkeypatch.setattr(transfer, "to_jax", lambda t: imports.append(t) or real_to_jax(t))
    monkeypatch.setattr(transfer, "kept", bt.KeptImport())
    monkeypatch.setattr(transfer, "order_programs", lambda: True)
    first, second = ours(x), ours(x)
    assert len(imports) == 1 and torch.equal(first, second)
    harness_rule(second, torch_reference(base, x, None))
    other = random_input(T.Config.from_object(CONFIG), 22)
    harness_rule(ours(other), torch_reference(base, other, None))
    assert len(imports) == 2
    monkeypatch.setattr(transfer, "order_programs", lambda: False)
    ours(x), ours(x)
    assert len(imports) == 4


def test_forward_keeps_the_mask_import_too_and_reads_its_current_contents(monkeypatch, harness_rule):
    """A mask-passing plan's mask is kept like x (its own slot) when the compute stream waited; the kept
    array aliases the mask's memory, so a write to the mask, seen by torch or not, reaches the next call."""
    base, ours = pair()
    config = T.Config.from_object(CONFIG)
    x = random_input(config, 23)
    mask = torch.ones(config.batch_size, config.seq_len, dtype=torch.bool)
    mask[:, :3] = False   # not a prefix: a general mask, which every plan passes to the program
    ours(x, mask)
    call = _only_call(ours)
    assert call.passes_mask
    transfer = call.transfer
    imports = []
    real_to_jax = transfer.to_jax
    monkeypatch.setattr(transfer, "to_jax", lambda t: imports.append(t) or real_to_jax(t))
    monkeypatch.setattr(transfer, "kept", bt.KeptImport())
    monkeypatch.setattr(transfer, "kept_mask", bt.KeptImport())
    monkeypatch.setattr(transfer, "order_programs", lambda: True)
    first, second = ours(x, mask), ours(x, mask)
    assert len(imports) == 2 and torch.equal(first, second)   # x and the mask, once each
    harness_rule(second, torch_reference(base, x, mask))
    mask.data[:, 5:7] = False   # behind the version counter: still a general mask, same memory
    harness_rule(ours(x, mask), torch_reference(base, x, mask), "after the write")
    assert len(imports) == 2


def test_refresh_after_a_mask_written_behind_torchs_back(harness_rule):
    """The documented remedy for the known limit (README): a mask written through `.data` keeps its version,
    so the cached kind would be stale; after refresh() the call is right again."""
    base, ours = pair()
    x, mask = make_inputs(CONFIG, 3)   # the all-True mask: planned mask-free
    with torch.inference_mode(False):
        ours(x, mask)
        version = mask._version
        mask.data[:, 10:] = False      # invisible to torch's version counter
        assert mask._version == version
        bridge.refresh(ours)
        harness_rule(ours(x, mask), base(x, mask), "after refresh")


@pytest.mark.parametrize("route", ["data", "numpy", "dlpack"])
def test_a_host_mask_written_behind_torchs_back_is_never_stale(route, harness_rule):
    """Writes that torch's version counter does not see (`.data`, a numpy view, a DLPack consumer) after a
    first call: the next call sees the new mask without refresh() (a host mask is read every call)."""
    import numpy as np
    base, ours = pair()
    x, mask = make_inputs(CONFIG, 4)   # the all-True mask: planned mask-free
    with torch.inference_mode(False):
        harness_rule(ours(x, mask), base(x, mask), "before the write")
        version = mask._version
        if route == "data":
            mask.data[:, 10:] = False
        elif route == "numpy":
            mask.numpy()[1, 3:] = False
        else:
            np.from_dlpack(mask)[0, ::3] = False   # a general (non-prefix) mask now
        assert mask._version == version and not bool(mask.all())
        harness_rule(ours(x, mask), base(x, mask), f"after a write through {route}")


def test_a_policy_named_in_the_environment_is_planned_and_passes_at_a_small_input_scale(monkeypatch):
    """TTJ_POLICY: the harness's --input-scale 0.01 at official shape 2, where the planner's fp16 GEMMs fail
    the rule against the float32 baseline and the compensated policy passes (read when a call signature is
    first planned; a name that is not a policy is a clear error)."""
    from bench.baseline import check_close, harness_models
    config = TransformerConfig(**vars(T.OFFICIAL["2"].config))
    x, mask = make_inputs(config, 1234, input_scale=0.01)
    monkeypatch.delenv("TTJ_POLICY", raising=False)
    baseline, planned = harness_models(config, bridge.TTJTransformer)
    (_, requested), (_, wrong) = (harness_models(config, bridge.TTJTransformer) for _ in range(2))
    with torch.inference_mode():
        ref = baseline(x, mask)
        assert check_close(planned(x, mask), ref)[0] > 0
        monkeypatch.setenv("TTJ_POLICY", "mixed_fp16x3")
        failed, worst = check_close(requested(x, mask), ref)
        assert failed == 0 and worst < 0.7
        assert "mixed_fp16x3" in bridge.explain(requested, x, mask) and "requested" in bridge.explain(requested, x, mask)
        monkeypatch.setenv("TTJ_POLICY", "fp8")
        with pytest.raises(ValueError, match="TTJ_POLICY='fp8' is not a numerics policy"):
            wrong(x, mask)
