"""The bridge's hot path: torch tensors in, ttj-jax's compiled forward, torch tensors out.

Per module, built once and reused (held in a WeakKeyDictionary, so nothing is added to the module):
- zero-copy jax views of the module's parameters (DLPack) and the prepared weights derived from them
  (fused QKV, fp16 copies), rebuilt only when a parameter's storage or version changes: `.to()` gives
  new storage, `load_state_dict` and in-place edits bump the version. The views hold the old storage
  alive, so a new allocation can never reuse a cached address (no false "unchanged").
- per input signature (shape, dtype, device, mask kind): the plan and its compiled executable.
- the kind of the last mask seen, keyed by the tensor object and its version counter.
Per call, the work is: a few attribute checks, the parameters' change check (bridge/versions.py), one DLPack import of x (the native
path, compat.DlpackImporter; on CUDA kept from the last call for the same x, Transfer.to_jax_kept,
unless TTJ_BRIDGE_KEEP_X_IMPORT=0),
the async jax dispatch, and one DLPack export. No host sync: torch's
pending writes to x are ordered before jax reads it by one cached CUDA event (Transfer), and torch's
stream waits on jax's result through the DLPack protocol on export; later torch writes to x are
therefore ordered after jax's reads too.
Calls the bridge launches itself (the Mosaic kernel, the rows stack's Triton kernels), their checks and
the native lane that repeats them: bridge/direct.py.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from itertools import chain
from operator import is_
from typing import Any

import jax
import numpy as np
import torch

from bridge import direct, native, settings
from bridge.direct import Call
from bridge.transfer import Transfer, current_cuda_device, torch_dtype_name, transfer_for
from bridge.versions import ParameterWatch
from ttj_jax import planner, stacks
from ttj_jax.config import Config
from ttj_jax.device import device_facts
from ttj_jax.masks import MaskKind, classify_mask
from ttj_jax.model import executable, model_key, plan_for, validate_inputs
from ttj_jax.numerics import get_policy
from ttj_jax.params import expected_shapes, params_from_state_dict, prepare_weights
from ttj_jax.planner import InputFacts, Plan
from ttj_jax.planner import plan as make_plan

_STATES: weakref.WeakKeyDictionary[torch.nn.Module, _ModuleState] = weakref.WeakKeyDictionary()
_PREPARE = {}   # policy name -> jitted prepare_weights
_dict_values = dict.values


# Bumped by torch's global registration hooks whenever any module anywhere gets a parameter or submodule
# assigned (`m.w = nn.Parameter(...)`, `load_state_dict(..., assign=True)`, `seq[0] = layer`, and every
# module construction): _ModuleState.check_structure compares the module's parameter objects only after
# it moved, so a steady stream of calls pays one integer comparison. The hooks return None (torch keeps
# what was assigned); `.to()` under torch's overwrite-on-conversion flag replaces parameters without
# them, which check_structure asks torch's flag about.
_REGISTRATIONS = [0]


def _count_registration(module, name, value) -> None:
    _REGISTRATIONS[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)
torch.nn.modules.module.register_module_module_registration_hook(_count_registration)
_overwrites_on_conversion = torch.__future__.get_overwrite_module_params_on_conversion


# Whether torch's current CUDA stream is capturing a graph: the C getter torch.cuda wraps.
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)


def read_mask_kind(mask: torch.Tensor) -> MaskKind:
    """A GPU mask's kind, read on the host: one device-to-host copy, which waits for the mask's writers."""
    return classify_mask(mask.detach().cpu().numpy())


class _ModuleState:
    def __init__(self, module: torch.nn.Module, config: Config):
        self.config = config
        self.model_key = model_key(config)
        self.generation = 0                      # counts the parameter changes seen (weights_generation)
        self.registrations = _REGISTRATIONS[0]
        self._collect(module)
        self.views: dict[str, Any] = {}          # name -> zero-copy jax view of the parameter
        self.prepared: dict[str, Any] = {}
        self.calls: dict[tuple, Call] = {}
        self.validated: set[tuple] = set()       # input signatures validate_inputs has passed
        self.gpu_mask_mode = settings.gpu_mask_mode()   # TTJ_GPU_MASK
        self.mask_on_device = self.gpu_mask_mode != "host"   # no GPU mask's kind is ever kept
        self.mask_ref = None
        self.mask_version = None
        self.mask_kind = None
        self.training_key = None                 # training_views(): the parameters' memory it was built for
        self.training_list = None
        self.training_tree_kept = None           # training_tree(): the views as the jax params pytree
        self.lane = None                         # the native lane repeating the last launched call (fast_forward)
        self.lane_key = None

    def _collect(self, module: torch.nn.Module) -> None:
        """The module's parameters by the harness's names (checked), and what check_structure compares:
        every submodule's `_parameters` and `_modules` dicts and their values as they are now."""
        config = self.config
        named = dict(module.named_parameters())
        expected = expected_shapes(config)
        missing = [n for n in expected if n not in named]
        if missing:
            raise ValueError(f"module {type(module).__name__} lacks parameter(s) {missing[:6]} "
                             f"that the config ({config}) needs: is it structured like the harness's "
                             "BaselineTransformer?")
        for name, shape in expected.items():
            if tuple(named[name].shape) != shape:
                raise ValueError(f"parameter {name} has shape {tuple(named[name].shape)}, the config "
                                 f"needs {shape}")
        self.names = list(expected)
        self.params = [named[n] for n in self.names]
        self.watch = ParameterWatch(self.params)   # unmarked: the next weights_generation() rebuilds
        modules = list(module.modules())
        self.containers = [m._parameters for m in modules] + [m._modules for m in modules]
        self.contents = list(chain.from_iterable(map(_dict_values, self.containers)))

    def check_structure(self, module: torch.nn.Module) -> None:
        """Notices parameters or submodules replaced by new objects since the last call (`m.w =
        nn.Parameter(...)`, `load_state_dict(..., assign=True)`, `.to()` under torch's
        overwrite-on-conversion flag, a submodule swapped): versions and data pointers, which
        the ParameterWatch compares, live on the old objects and would not change. Then the parameters are
        collected again and every cached weight is rebuilt. The identity comparison of every dict entry
        (~6 us for an official shape's module on the CPU) runs only after a registration anywhere in the
        process (_REGISTRATIONS) or under torch's overwrite-on-conversion flag, else one int comparison."""
        registrations = _REGISTRATIONS[0]
        if self.registrations == registrations and not _overwrites_on_conversion():
            return
        contents = list(chain.from_iterable(map(_dict_values, self.containers)))
        if len(contents) != len(self.contents) or not all(map(is_, contents, self.contents)):
            self._collect(module)   # raises if the module no longer fits the config: checked again next call
        self.registrations = registrations

    def weights_generation(self) -> int:
        """A number that changes whenever a parameter changed since the last call (a version counter or a
        data pointer moved: bridge/versions.py; replaced objects: check_structure): then every cached
        derivation is dropped first, so nothing keeps the old weights alive."""
        if self.watch.changed():   # also after _collect made a new, unmarked watch
            self.prepared.clear()
            self.views = {}
            self.lane = self.lane_key = None   # it holds the old kernel weights; the next launch arms a new one
            for call in self.calls.values():
                call.weights = None
            self.watch.mark()
            self.generation += 1
        return self.generation

    def weights(self, policy_name: str, data_parallel: int = 1):
        self.weights_generation()
        return self._derived(policy_name, data_parallel, lambda: self._prepare(policy_name))

    def kernel_jax_weights(self, stack: str, data_parallel: int = 1, policy_name: str = "mixed_fp16"):
        """A stack's own weight layout as jax arrays ("layers": StackedWeights, "fused": FusedWeights,
        "fused_mgpu": MgpuStackWeights, "rows": RowsWeights; or another layout a plan names,
        stacks.weights_layout), from the weights prepared for `policy_name`, built once per weight version
        (and replicated once over the mesh of a split plan)."""
        prepared = self.weights(policy_name)
        return self._derived(f"{stack}-{policy_name}-jax", data_parallel,
                             lambda: stacks.kernel_weights(prepared, self.model_key, stack))

    def _derived(self, name: str, data_parallel: int, build: Callable):
        """self.prepared[(name, n)]: built by build() once per weight version (weights() clears the cache
        when a parameter changes) and, for a split over n > 1 devices, replicated over the mesh once, not
        on every call."""
        value = self.prepared.get((name, data_parallel))
        if value is None:
            value = self.prepared.get((name, 1))
            if value is None:
                value = self.prepared[(name, 1)] = build()
            if data_parallel > 1:
                from jax.sharding import NamedSharding, PartitionSpec

                from ttj_jax.parallel import batch_mesh
                mesh = batch_mesh(data_parallel, jax.default_backend())
                value = self.prepared[(name, data_parallel)] = jax.device_put(
                    value, NamedSharding(mesh, PartitionSpec()))
        return value

    def kernel_tensors(self, stack: str) -> list[torch.Tensor]:
        """A whole-stack kernel's weights as torch tensors on the weights' device, in the order its launch
        takes them (`Stack.weight_arrays`), built by jax from the
        current parameters once per weight version. They are torch-owned copies, so torch's allocator
        orders their reuse after the kernels that read them on torch's stream."""
        self.weights("mixed_fp16")   # drops every derived array when a parameter changed
        tensors = self.prepared.get(f"{stack}-torch")
        if tensors is None:
            arrays = stacks.get(stack).weight_arrays(self.kernel_jax_weights(stack))
            transfer = transfer_for(self.params[0].device)
            tensors = [transfer.to_torch(a).clone() for a in arrays]
            self.prepared[f"{stack}-torch"] = tensors
        return tensors

    def _prepare(self, policy_name: str):
        device = self.params[0].device
        for name, p in zip(self.names, self.params):
            if p.device != device:
                raise ValueError(f"parameter {name} is on {p.device} but {self.names[0]} is on {device}")
        if not self.views:
            transfer = transfer_for(device)
            transfer.order_before_jax()
            for name, p in zip(self.names, self.params):
                t = p.detach()
                if t.dtype == torch.float64:     # jax without x64 mode computes in float32
                    t = t.float()
                self.views[name] = transfer.to_jax(t if t.is_contiguous() else t.contiguous())
        raw = params_from_state_dict(self.views, self.config)
        prepare = _PREPARE.get(policy_name)
        if prepare is None:
            policy = get_policy(policy_name)
            prepare = _PREPARE[policy_name] = jax.jit(lambda params: prepare_weights(params, policy))
        return prepare(raw)

    def training_views(self) -> list | None:
        """Zero-copy jax views of the parameters (harness order) for the training path, kept while their
        data pointers, shapes, strides and dtypes stay: an optimizer's in-place update changes the values,
        which the views share, not the memory. None where a parameter is not contiguous float32 (a view
        would then be a copy, stale after an update): the caller imports per call."""
        key = [(p.data_ptr(), p.shape, p.stride(), p.dtype) for p in self.params]
        if key != self.training_key:
            self.training_key, self.training_list = None, None
            if not all(p.dtype == torch.float32 and p.is_contiguous() for p in self.params):
                return None
            transfer = transfer_for(self.params[0].device)
            views = [transfer.to_jax(p.detach()) for p in self.params]
            if any(v.unsafe_buffer_pointer() != p.data_ptr() for v, p in zip(views, self.params)):
                return None   # an import that copied (alignment) would go stale: import per call
            self.training_list, self.training_key = views, key
            self.training_tree_kept = params_from_state_dict(dict(zip(expected_shapes(self.config), views)),
                                                             self.config)
        return self.training_list

    def training_tree(self):
        """training_views() as the params pytree the jax programs take, built once per set of views (~120
        us of host time per call otherwise, on the CPU machine for 66 parameters); None as there."""
        return None if self.training_views() is None else self.training_tree_kept

    def classify(self, mask: torch.Tensor) -> MaskKind:
        """The mask's kind ([B, S] mask, validated). A mask in host memory is read on every call (no device
        to wait for), so no write can make it stale: through `.data`, a numpy view or a DLPack consumer
        alike. A GPU mask (TTJ_GPU_MASK, bridge/settings.py): under "auto" read on every call where the
        call's work makes the host sync cheap (planner.reads_gpu_mask_on_host), else left to the device
        (MaskKind.UNKNOWN), as under "device"; under "host" read once per tensor object and version, and
        left to the device for an inference tensor (no version counter: its contents could change unseen)."""
        if mask.device.type == "cpu":
            return classify_mask(mask.detach().numpy())
        if self.mask_on_device:
            return read_mask_kind(mask) if self._reads_each_call(mask) else MaskKind.UNKNOWN
        if mask.is_inference():
            return MaskKind.UNKNOWN
        version = mask._version
        if self.mask_ref is not None and self.mask_ref() is mask and self.mask_version == version:
            return self.mask_kind
        kind = read_mask_kind(mask)
        self.mask_ref, self.mask_version, self.mask_kind = weakref.ref(mask), version, kind
        return kind

    def _reads_each_call(self, mask: torch.Tensor) -> bool:
        """TTJ_GPU_MASK=auto at a call size whose work makes a host read cheap (planner.reads_gpu_mask_on_host)."""
        return self.gpu_mask_mode == "auto" and planner.reads_gpu_mask_on_host(self.config, *mask.shape)

    def mask_reading(self, mask: torch.Tensor | None) -> str:
        """How this mask's kind is found, in words (explain())."""
        if mask is None or mask.device.type == "cpu":
            return ""
        if self.mask_on_device:
            if self._reads_each_call(mask):
                return (f"GPU mask read on the host on every call (TTJ_GPU_MASK=auto, at least "
                        f"{planner.HOST_MASK_READ_MIN_FLOP:.0e} FLOP of work)")
            return f"GPU mask decided on the device on every call (TTJ_GPU_MASK={self.gpu_mask_mode})"
        if mask.is_inference():
            return "GPU inference-tensor mask decided on the device on every call"
        return "GPU mask read on the host once per tensor and version (TTJ_GPU_MASK=host)"

    def call_weights(self, call: Call):
        """The weights `call`'s jax program takes: kept on the call with the generation they were built
        in, rebuilt through the caches when a parameter changed."""
        generation = self.weights_generation()
        if generation != call.weights_generation:   # first call, or a parameter changed: the caches decide
            if stacks.layout_builder(call.plan) is not None:   # the plan's own layout
                call.weights = self.kernel_jax_weights(stacks.weights_layout(call.plan), call.plan.data_parallel,
                                                       call.plan.policy)
            else:
                call.weights = self.weights(call.plan.policy, call.plan.data_parallel)
            call.weights_generation = generation
        return call.weights

    def build_call(self, x: torch.Tensor, kind: MaskKind, data_parallel: int | None = None,
                   stack: str | None = None) -> Call:
        if x.device != self.params[0].device:
            raise ValueError(f"x is on {x.device} but the module's weights are on {self.params[0].device}")
        transfer = transfer_for(x.device)
        jax_device = transfer.importer.device
        upcast = x.dtype if x.dtype == torch.float64 or direct.half_runs_as_float32(self, x, kind, jax_device) else None
        shape_probe = jax.ShapeDtypeStruct(tuple(x.shape), "float32" if upcast else torch_dtype_name(x.dtype))
        launched = direct.self_launched_stacks(self.config, x.shape[0], x.shape[1], x.device)
        policy = settings.requested_policy()
        forced = any(value is not None for value in (data_parallel, stack, policy))   # the rules' plan, as asked
        replanned = ""
        while True:
            plan = plan_for(self.config, shape_probe, kind, device=jax_device or jax.devices(
                "cpu" if x.device.type == "cpu" else None)[0], caller="torch", data_parallel=data_parallel,
                stack=stack, policy=policy, self_launched=launched)
            call = self._call_for(plan, x, transfer, upcast)
            if forced or call.direct is not None or not planner.launched_by_caller(plan, InputFacts(
                    x.shape[0], x.shape[1], shape_probe.dtype.name, kind, caller="torch", self_launched=launched)):
                break
            # The planner counted on the bridge launching this plan's kernels (no jax dispatch), and the
            # launch was refused: plan again as a caller that does not launch that stack, so the plans
            # through jax are compared with it on equal terms (one more measurement, once per signature).
            replanned = f"{plan.name} planned first, its launch refused ({call.direct_note}); planned again without it"
            launched = tuple(s for s in launched if s != plan.stack)
        if replanned:
            call.direct_note = f"{call.direct_note}; {replanned}" if call.direct_note else replanned
        if call.direct is not None and x.device.type == "cuda":
            call.direct_device = x.device.index   # a CUDA tensor's device always carries its index
        return call

    def _call_for(self, plan: Plan, x: torch.Tensor, transfer, upcast) -> Call:
        """The call record of `plan` for x, with the bridge's own launch of its kernels where it has one."""
        call = Call(plan=plan, run=executable(plan, self.model_key), transfer=transfer,
                    passes_mask=plan.mask_mode != "none", upcast_to=upcast)
        bridge_launch = stacks.get(plan.stack).bridge_launch
        if bridge_launch is not None and plan.data_parallel > 1:
            call.direct_note = f"the batch is split over {plan.data_parallel} devices, one kernel per device"
        elif bridge_launch is not None:
            call.direct, call.direct_note = direct.mosaic_kernel(self, call, x.shape, x.device,
                                                                 torch.float32 if upcast else x.dtype)
        elif stacks.get(plan.stack).kernels_only and plan.data_parallel == 1:
            call.direct, call.direct_note = direct.triton_kernels(self, call, x)
        return call


def _state(module: torch.nn.Module, config) -> _ModuleState:
    state = _STATES.get(module)
    if state is None:
        config = Config.from_object(config if config is not None else _config_of(module))
        state = _STATES[module] = _ModuleState(module, config)
    else:
        state.check_structure(module)
    return state


def harness_parameters(module: torch.nn.Module, config=None) -> tuple[Config, list[torch.Tensor]]:
    """(the module's config, its parameters in the harness's order), as the bridge keeps them (collected
    once, collected again when a parameter or submodule is replaced)."""
    state = _state(module, config)
    return state.config, state.params


def training_parameters(module: torch.nn.Module, config=None) -> tuple[Config, list[torch.Tensor], Any]:
    """harness_parameters plus _ModuleState.training_tree: the kept views as the jax params pytree (None
    where they cannot be kept)."""
    state = _state(module, config)
    return state.config, state.params, state.training_tree()


def module_state(module: torch.nn.Module) -> _ModuleState:
    """What the bridge keeps for `module` (its weights' caches and its calls by input signature), for
    diagnostic tools; KeyError before the module's first call."""
    return _STATES[module]


def _config_of(module: torch.nn.Module):
    config = getattr(module, "config", None)
    if config is None:
        raise ValueError(f"{type(module).__name__} has no `config` attribute; pass config= (an object with "
                         "batch_size, seq_len, d_model, num_heads, ffn_dim, num_layers, causal)")
    return config


def forward(module: torch.nn.Module, x: torch.Tensor, valid_token_mask: torch.Tensor | None = None, *,
            config=None, data_parallel: int | None = None, stack: str | None = None,
            split_chunks: int | tuple[int, ...] | None = None, split_home_rows: int = 0) -> torch.Tensor:
    """Runs ttj-jax on `module`'s own parameters (any module with the harness's parameter names).
    Returns a new tensor with x's shape, dtype and device; never modifies its inputs. Records nothing for
    autograd: bridge.ops.forward sends calls that need gradients through the custom op instead.
    stack: force "layers" (the XLA program), "fused" (the whole-stack kernel), "fused_mgpu" (the same as
    one Mosaic GPU kernel, Hopper) or "rows" (row-tile kernels around attention) instead of the planner's
    choice (ablations, benchmarks).
    data_parallel: split the batch over that many devices (default: the planner's choice; the output
    is gathered back to x's device). split_chunks: a split call goes through in this many consecutive
    chunks, so that its copies between GPUs overlap compute (see _run_split); the batch must divide
    into data_parallel * split_chunks. None: ttj_jax.parallel.default_split_chunks (4 where the batch
    divides so, as measured best on two H200s). Or a tuple of weights, chunks in those proportions
    (ttj_jax.parallel.split_chunk_rows): (1, 4, 4, 1) keeps the copies before the first chunk and after
    the last one short (on two H200s no faster than equal chunks at shape 6). split_home_rows: that many
    rows at the end of the batch are computed by x's own GPU alone, beside the split of the rest (which
    must then divide evenly), meant to offload the other GPUs, which also wait for their copies; on two
    H200s 2-8% of shape 6 that way was slower, not faster."""
    state = _state(module, config)
    lane_options = data_parallel is None and stack is None and split_chunks is None and split_home_rows == 0
    if split_chunks is not None or type(split_home_rows) is not int or split_home_rows:   # not the defaults
        if isinstance(split_chunks, list):
            split_chunks = tuple(split_chunks)
        if split_chunks is not None and (isinstance(split_chunks, bool) or not isinstance(split_chunks, (int, tuple))
                                         or (isinstance(split_chunks, int) and split_chunks < 1)):
            raise ValueError(f"split_chunks must be an int >= 1 or a tuple of positive int weights; got {split_chunks!r}")
        if isinstance(split_home_rows, bool) or not isinstance(split_home_rows, int) or split_home_rows < 0:
            raise ValueError(f"split_home_rows must be an int >= 0; got {split_home_rows!r}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor [batch, seq_len, d_model]; got {type(x).__name__}")
    if x.is_cuda and _capturing():
        raise RuntimeError("ttj-jax cannot run inside CUDA graph capture: jax's launches are not captured by "
                           "torch, so a replay would return stale output. Capture the code around it, or "
                           "use torch.compile's default mode")
    mask = valid_token_mask
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"valid_token_mask must be a torch.Tensor or None; got {type(mask).__name__}")
        if mask.device != x.device:
            raise ValueError(f"valid_token_mask is on {mask.device} but x is on {x.device}")
    signature = (x.shape, x.dtype, None if mask is None else (mask.shape, mask.dtype))
    if signature not in state.validated:   # the checks depend on shapes and dtypes only: once each
        validate_inputs(x.shape, torch_dtype_name(x.dtype), None if mask is None else mask.shape,
                        None if mask is None else torch_dtype_name(mask.dtype), state.config)
        state.validated.add(signature)

    kind = MaskKind.NONE if mask is None else state.classify(mask)
    key = (x.shape, x.dtype, x.device, kind, data_parallel, stack)
    call = state.calls.get(key)
    if call is None:
        with _current_device_kept(x.device):   # building compiles and places weights, maybe on other GPUs
            call = state.calls[key] = state.build_call(x, kind, data_parallel, stack)
    if call.plan.data_parallel > 1:
        with _current_device_kept(x.device):   # jax's program over several GPUs moves the current device
            return _forward_split(state, call, x, mask, kind, split_chunks, split_home_rows)

    if call.direct is not None:   # one kernel launch on torch's current stream, no JAX dispatch
        tensors = state.kernel_tensors(call.plan.stack)
        contiguous = x.is_contiguous()
        if call.upcast_to is not None:
            x = x.float()
        x = direct.launchable(x)
        if call.passes_mask:
            mask = direct.launchable(mask)
        if call.direct_device is not None and current_cuda_device() != call.direct_device:
            # The kernel module lives in x's GPU's context: launched with another GPU current (a jax
            # call on several GPUs can leave one so) it ran nowhere, silently (seen on two H200s:
            # 0.05 ms "calls" of shape 6 after a split call). Rare: the check is one C call.
            with torch.cuda.device(x.device):
                out = call.direct(x, mask, tensors)
        else:
            out = call.direct(x, mask, tensors)
            if contiguous and lane_options:
                direct.arm_lane(state, call, x, mask, kind, tensors)
        return out if call.upcast_to is None else out.to(call.upcast_to)

    weights = state.call_weights(call)
    x, mask = _jax_inputs(call, x, mask)
    transfer = call.transfer
    if transfer.order_programs():   # kept imports: ~40-70 us of host time each on the H200 host otherwise
        jx = transfer.to_jax_kept(x)
        jmask = transfer.to_jax_kept(mask, transfer.kept_mask) if call.passes_mask else None
    else:
        jx = transfer.to_jax(x)
        jmask = transfer.to_jax(mask) if call.passes_mask else None
    out = transfer.to_torch(call.run(weights, jx, jmask))
    return out if call.upcast_to is None else out.to(call.upcast_to)


def fast_forward(module: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
    """The output of forward(module, x, mask) with no options, through the module's native lane
    (bridge/native) when this call repeats the last launched one on unchanged inputs; else None (the
    caller then runs forward). The lane makes forward's checks in C++; the two made here are the ones it
    cannot see: a parameter or submodule replaced (check_structure) and torch's overwrite-on-conversion flag."""
    state = _STATES.get(module)
    lane = state.lane if state is not None else None
    if lane is None or state.registrations != _REGISTRATIONS[0] or _overwrites_on_conversion():
        return None
    return lane.run(x, mask)


def _jax_inputs(call: Call, x: torch.Tensor, mask: torch.Tensor | None):
    """x and the mask as the call's jax program takes them: detached, upcast where the plan says,
    contiguous (copies only where needed)."""
    if x.requires_grad:
        x = x.detach()
    if call.upcast_to is not None:
        x = x.float()
    x = x if x.is_contiguous() else x.contiguous()
    mask = mask if not call.passes_mask or mask.is_contiguous() else mask.contiguous()
    return x, mask


@contextlib.contextmanager
def _current_device_kept(device: torch.device):
    """The current CUDA device as it was before the block (a jax call over several GPUs, or a stream
    context of another GPU, can leave another current: the harness's next launch would then go astray)."""
    if device.type != "cuda":
        yield
        return
    entry = current_cuda_device()
    try:
        yield
    finally:
        if current_cuda_device() != entry:
            torch.cuda.set_device(entry)


def _forward_split(state: _ModuleState, call: Call, x: torch.Tensor, mask: torch.Tensor | None, kind: MaskKind,
                   split_chunks, split_home_rows: int) -> torch.Tensor:
    """forward's path for a plan split over several devices (see _run_split)."""
    weights = state.call_weights(call)
    x, mask = _jax_inputs(call, x, mask)
    home = None
    if split_home_rows:
        if split_home_rows >= x.shape[0]:
            raise ValueError(f"split_home_rows={split_home_rows} leaves none of the batch {x.shape[0]} to split")
        rows = x[x.shape[0] - split_home_rows:]
        home_key = (rows.shape, rows.dtype, rows.device, kind, 1, call.plan.stack)
        home = state.calls.get(home_key)
        if home is None:
            home = state.calls[home_key] = state.build_call(rows, kind, 1, call.plan.stack)
        home = (split_home_rows, home, state.call_weights(home))
    out = _run_split(call, weights, x, mask if call.passes_mask else None, split_chunks, home_part=home)
    return out if call.upcast_to is None else out.to(call.upcast_to)


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One cached side stream per GPU for a split's copies."""
    stream = _SIDE_STREAMS.get(device.index)
    if stream is None:
        stream = _SIDE_STREAMS[device.index] = torch.cuda.Stream(device)
    return stream


@contextlib.contextmanager
def _side_streams(devices: list[torch.device]):
    """Each device's side stream (_side_stream) current on it for the block."""
    with contextlib.ExitStack() as stack:
        for device in devices:
            stack.enter_context(torch.cuda.stream(_side_stream(device)))
        yield


def _run_split(call: Call, weights, x: torch.Tensor, mask: torch.Tensor | None, chunks: int | tuple | None = None,
               home_part: tuple[int, Call, Any] | None = None) -> torch.Tensor:
    """The batch split over the plan's devices, in `chunks` consecutive SPMD calls (each one split over
    the devices like the whole; chunks=1: one call). Each device's slice of a chunk is moved by torch
    (a peer-to-peer copy between GPUs) and imported on its device; the slices form one batch-sharded
    jax array, so jax's program moves nothing; each output shard comes back to torch on its device and
    torch copies it into the output on x's device. Moving the slices with jax instead went through host
    memory on two H200s (~2 GB/s).

    On CUDA, the copies run on one side stream per GPU, ordered by events, never on the caller's stream:
    all chunks' copies out of x are queued first (on x's GPU's side stream, after x's producers), each
    chunk's program waits only for its own slices (one event per chunk and device), and each output
    shard of another GPU is copied back on that GPU's side stream as soon as its chunk is done. So with
    chunks > 1 the copies in both directions overlap the other chunks' compute. The caller's stream
    waits for every copy into the output. At the end each GPU's stream for jax's external ready events
    waits for the copies out of jax's output buffers; that this also orders jax's reuse of those buffers
    is an assumption, not verified (see Transfer: those events order later imports, and nothing shows
    that jax's allocator consults that stream). On the CPU (tests, several host devices) jax places the
    slices.

    home_part: (rows, a one-device call, its weights) for the rows at the end of x that x's own device
    computes alone (forward's split_home_rows); the split covers the rows before them. That call runs
    through jax (never a direct launch on the caller's stream) after the split's chunks on x's GPU, and
    its output is copied last, so that no copy of another GPU's output waits for it."""
    from jax.sharding import NamedSharding, PartitionSpec

    from ttj_jax.parallel import BATCH_AXIS, batch_mesh, default_split_chunks, split_chunk_rows
    n = call.plan.data_parallel
    home_rows = 0 if home_part is None else home_part[0]
    split_rows = x.shape[0] - home_rows
    if chunks is None:
        chunks = default_split_chunks(split_rows, n)
    try:
        chunk_rows = split_chunk_rows(split_rows, n, chunks)
    except ValueError as e:
        raise ValueError(f"{e}{f' (after {home_rows} home rows)' if home_rows else ''}") from None
    chunk_starts = [sum(chunk_rows[:c]) for c in range(len(chunk_rows))]
    chunks = len(chunk_rows)
    mesh = batch_mesh(n, jax.default_backend())
    devices = list(mesh.devices.flat)
    sharding = NamedSharding(mesh, PartitionSpec(BATCH_AXIS))
    tensors = [x] + ([mask] if mask is not None else [])

    def rows(c: int, k: int) -> slice:
        per_device = chunk_rows[c] // n
        start = chunk_starts[c] + k * per_device
        return slice(start, start + per_device)

    def run_chunk(c: int, parts):   # parts[k]: the jax arrays (x, and mask) of device k's slice of chunk c
        arrays = [jax.make_array_from_single_device_arrays((chunk_rows[c],) + tuple(t.shape[1:]), sharding,
                                                           [p[i] for p in parts]) for i, t in enumerate(tensors)]
        return call.run(weights, arrays[0], arrays[1] if mask is not None else None)

    def run_home_part(transfer: Transfer):   # the home rows on x's device, through jax
        _, home_call, home_weights = home_part
        local = [transfer.to_jax(t[split_rows:]) for t in tensors]
        return home_call.run(home_weights, local[0], local[1] if mask is not None else None)

    out = torch.empty(tuple(x.shape), dtype=x.dtype, device=x.device)
    if x.device.type != "cuda":
        for c in range(chunks):
            y = run_chunk(c, [[jax.device_put(call.transfer.to_jax(t[rows(c, k)].contiguous()), device)
                            for t in tensors] for k, device in enumerate(devices)])
            for shard in y.addressable_shards:
                k = devices.index(shard.device)
                out[rows(c, k)].copy_(call.transfer.to_torch(shard.data))
        if home_part is not None:
            out[split_rows:].copy_(call.transfer.to_torch(run_home_part(call.transfer)))
        return out

    home = x.device
    home_transfer = transfer_for(home)
    home_transfer.order_before_jax()   # jax on x's GPU reads x's slices in place: after x's producers
    targets = [torch.device("cuda", d.local_hardware_id) for d in devices]
    others = [target for target in targets if target != home]
    copy_out_of_x = _side_stream(home)
    copy_out_of_x.wait_stream(torch.cuda.current_stream(home))
    moved, ready = [], []   # per chunk, per device: the slices there, and the event after their copy
    # Each stream context is entered once per call, not per chunk: entering one costs tens of us of host
    # time, and a split call is host-heavy.
    with _side_streams([home] + others):   # torch syncs both devices' streams
        for c in range(chunks):
            moved.append([]), ready.append([])
            for k, target in enumerate(targets):
                pieces = [t[rows(c, k)] for t in tensors]
                event = None
                if target != home:
                    pieces = [p.to(target, non_blocking=True) for p in pieces]
                    event = torch.cuda.Event()
                    event.record(_side_stream(target))
                moved[c].append(pieces)
                ready[c].append(event)
    results = []
    for c in range(chunks):
        parts = []
        for k, target in enumerate(targets):
            transfer = transfer_for(target)
            if ready[c][k] is not None:
                transfer.jax_stream.wait_event(ready[c][k])
            parts.append([transfer.to_jax(p) for p in moved[c][k]])
        results.append(run_chunk(c, parts))
    home_y = None if home_part is None else run_home_part(home_transfer)   # queued after the chunks
    with _side_streams(others):   # x's GPU keeps the caller's stream current
        for c, y in enumerate(results):
            for shard in sorted(y.addressable_shards, key=lambda s: devices.index(s.device)):
                k = devices.index(shard.device)
                # x's GPU: on the caller's stream, after jax's chunk (DLPack protocol); another GPU: on its
                # side stream, and torch makes the caller's stream wait for the copy
                transfer = home_transfer if targets[k] == home else transfer_for(targets[k])
                out[rows(c, k)].copy_(transfer.to_torch(shard.data), non_blocking=True)
    if home_y is not None:   # last on the caller's stream: the copies above do not wait for it
        out[split_rows:].copy_(home_transfer.to_torch(home_y), non_blocking=True)
    # Meant: jax reuses its output buffers (freed below) only after torch has copied out of them (the
    # assumption stated in the docstring).
    home_transfer.order_before_jax()
    for target in others:
        done = torch.cuda.Event()
        done.record(_side_stream(target))
        transfer_for(target).jax_stream.wait_event(done)
    # The moved slices (allocated on the side streams) are freed only now: every later use of those
    # streams' memory is queued after the copies above, which wait for the programs that read them.
    del moved, results, home_y
    return out


def explain(module: torch.nn.Module, x: torch.Tensor, valid_token_mask=None, *, config=None) -> str:
    """The one-line plan the bridge runs for this input, and how the bridge launches it."""
    state = _state(module, config)
    kind = MaskKind.NONE if valid_token_mask is None else state.classify(valid_token_mask)
    key = (x.shape, x.dtype, x.device, kind, None, None)   # what forward() with no overrides runs
    call = state.calls.get(key)
    if call is None:
        call = state.calls[key] = state.build_call(x, kind)
    text = call.plan.explain()
    if reading := state.mask_reading(valid_token_mask):
        text += f"; {reading}"
    stack = stacks.get(call.plan.stack)
    if call.direct is not None and stack.kernels_only:
        text += (f"; its {call.direct.num_kernels} Triton kernel(s) launched directly on torch's current stream "
                 "(no JAX dispatch)")
        if x.device.type == "cuda":
            text += "; " + native.describe()
    elif call.direct is not None:
        text += "; launched directly on torch's current stream (no JAX dispatch)"
        if getattr(call.direct, "kernel", None) is not None and x.device.type == "cuda":
            text += "; " + native.describe()
    elif (stack.bridge_launch is not None or (stack.kernels_only and stack.name in settings.triton_launch_stacks())
          or call.direct_note):
        text += f"; run through jax: {call.direct_note}"
    return text


def weight_views(module: torch.nn.Module) -> dict[str, Any]:
    """The jax arrays the bridge reads the module's parameters through (empty before the first call);
    for parameters that are contiguous float32/16 they share the parameter's memory."""
    state = _STATES.get(module)
    return dict(state.views) if state is not None else {}


def refresh(module: torch.nn.Module) -> None:
    """Forgets everything cached for `module`. Needed only after changes the bridge cannot see: writes
    through `param.data` (which bypass the version counter). Replaced Parameter objects are noticed
    (_ModuleState.check_structure)."""
    _STATES.pop(module, None)


def _host_numpy(t: torch.Tensor):
    """A host tensor as a numpy array, zero-copy where numpy has the dtype (bf16 through ml_dtypes)."""
    t = t.detach()
    if t.dtype == torch.float64:
        t = t.float()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _progress_printer(label: str):
    import sys

    def report(done: int, total: int):
        print(f"\r{label}: chunk {done}/{total}", end="\n" if done == total else "", file=sys.stderr, flush=True)
    return report


def stream_forward(module: torch.nn.Module, x: torch.Tensor, valid_token_mask: torch.Tensor | None = None, *,
                   config=None, batch_chunk: int | None = None, progress=True) -> torch.Tensor:
    """For x in host memory (a CPU tensor, pinned or not) with the module's weights on any device: the
    batch streams through the weights' device in chunks, copies overlapped with compute
    (ttj_jax.streaming). Returns a new CPU tensor of x's dtype. progress: True prints per-chunk progress
    to stderr; a callable(done, total) receives it; False is silent."""
    from ttj_jax.streaming import stream_forward as stream

    state = _state(module, config)
    if not isinstance(x, torch.Tensor) or x.device.type != "cpu":
        raise ValueError("stream_forward takes x in host memory (a CPU torch.Tensor); for x already on the "
                         f"device call bridge.forward; got {getattr(x, 'device', type(x).__name__)}")
    mask = valid_token_mask
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.device.type != "cpu"):
        raise ValueError("valid_token_mask must be a CPU torch.Tensor like x, or None")
    validate_inputs(x.shape, torch_dtype_name(x.dtype), None if mask is None else mask.shape,
                    None if mask is None else torch_dtype_name(mask.dtype), state.config)
    jax_device = transfer_for(state.params[0].device).importer.device or jax.devices()[0]
    x_np = _host_numpy(x)
    mask_np = None if mask is None else mask.numpy()
    facts = InputFacts(x.shape[0], x.shape[1], x_np.dtype.name,
                       classify_mask(mask_np) if mask_np is not None else MaskKind.NONE)
    policy = make_plan(state.config, facts, device_facts(jax_device)).policy
    report = _progress_printer("ttj-jax stream") if progress is True else (progress or None)
    y = stream(state.weights(policy), x_np, mask_np, config=state.config, device=jax_device,
               batch_chunk=batch_chunk, policy=policy, progress=report)
    out = torch.from_numpy(y.view(np.int16)).view(torch.bfloat16) if x.dtype == torch.bfloat16 \
        else torch.from_numpy(y)
    return out.to(x.dtype) if x.dtype == torch.float64 else out
