"""The planner: a pure function from (config, input facts, device facts) to a named plan.

Nothing here touches a device or an array; `device.device_facts()` reads the facts the planner is then
handed. Each rule names the measurement or constraint behind it in the plan's `reason`,
so `Plan.explain()` says in one line what will run and why.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ttj_jax.config import Config
from ttj_jax.device import CPU, DeviceFacts, device_facts  # noqa: F401  (re-exported: the planner's inputs)
from ttj_jax.masks import MaskKind
from ttj_jax.numerics import POLICIES

ATTENTION_IMPLEMENTATIONS = ("xla", "pallas", "cudnn")
MASK_MODES = ("none", "rows", "keys", "device")
KEY_MASK_MODES = ("keys", "device")   # the modes whose plans mask keys (the rest at most zero rows)
# What runs the layers (stacks.py has one entry per name):
# "layers": the XLA program, layer by layer (layers.py);
# "fused": the whole stack as one Pallas (Triton) kernel (kernels/fused_stack.py);
# "rows": per layer our flash attention and one row-tile kernel for the rest (kernels/row_block.py);
# "fused_mgpu": the whole stack as one Mosaic GPU kernel (kernels/fused_stack_mgpu.py, Hopper; any mask
# in its masked build), which the torch bridge launches on torch's stream without JAX dispatch.
STACKS = ("layers", "fused", "rows", "fused_mgpu")
CALLERS = ("jax", "torch")
# Rows per program of the "rows" stack (batch * seq_len must be a multiple): the fastest of 12 tilings
# at shape 13 and within 1% of the fastest at shape 11.
ROWS_BLOCK = 64

# Split the batch over several devices only from this many elements per call: smaller calls are
# launch-bound. From a torch tensor on one device the bridge moves the slices by peer-to-peer copies
# that overlap compute, over at most SPLIT_FROM_ONE_DEVICE_MAX devices (two H200s: shape 14 1.99x, shape
# 6 1.74x). A JAX caller's one-device array stays: jax's own device_put between GPUs went through host
# memory (~2 GB/s, slower than one GPU).
DATA_PARALLEL_MIN_ELEMENTS = 64 * 2**20
SPLIT_FROM_ONE_DEVICE_MAX = 2
# One long mask-free sequence from JAX on several GPUs: split the sequence, attention as a ring
# (ring_attention.py). Two H200s, B=1, d=1024: S=100,000 1.70x, S=1,000,000 1.87x, S=16,384 0.77x.
SEQUENCE_PARALLEL_MIN_LEN = 100_000
SEQUENCE_PARALLEL_MAX_BATCH = 1
# Activations of one chunk may take at most this share of the device's memory.
ACTIVATION_MEMORY_SHARE = 0.25
# Attention: our Pallas kernel beats XLA's explicit softmax everywhere measured and cuDNN up to S=1024;
# cuDNN wins at long sequences (S=16384, hd 64: 412 against 346 TFLOP/s) where it applies (no key mask,
# head_dim a multiple of 8 up to 128).
CUDNN_MIN_SEQ_LEN = 4096
# Without causal masking (encoders), cuDNN's attention in the XLA program beat our kernel's at every length
# measured: our kernel's lead up to S=1024 was measured on the official shapes, all causal.
CUDNN_NON_CAUSAL = ("measured faster than our kernel in the XLA program at S=197 and 512 (one H100, whole calls: "
                    "vit-s197 0.619 against 0.644 ms, bert-base 1.800 against 1.865 in the default numerics, "
                    "0.433 / 0.477 and 1.314 / 1.341 in the GEMM-bound ones; "
                    "bench/results/general-2026-12-05-h100-qkv3.json)")
CUDNN_HEAD_DIMS = range(8, 129, 8)
# With a key mask, cuDNN's q, k and v carry this many lanes more per head (layers.cudnn_attention).
CUDNN_MASK_LANES = 8
CUDNN_MASKED_MAX_HEAD_DIM = CUDNN_HEAD_DIMS[-1] - CUDNN_MASK_LANES


def cudnn_takes_head_dim(head_dim: int, masked: bool) -> bool:
    """Whether cuDNN's attention (layers.cudnn_attention) takes this head_dim: one of CUDNN_HEAD_DIMS,
    with room for the mask's lanes where it masks keys."""
    return head_dim in CUDNN_HEAD_DIMS and (not masked or head_dim <= CUDNN_MASKED_MAX_HEAD_DIM)


# From these head_dims' thresholds on, our Hopper kernel beats cuDNN (H200, fp16, causal). The length
# is the later of CUDNN_MIN_SEQ_LEN and the kernel's own dispatch threshold
# (`flash_attention_mgpu.dispatch_min_seq_len`), so the two rules cannot drift apart.
HOPPER_OVER_CUDNN = {
    64: "measured faster than cuDNN at shape 14's attention call (481 against 446 TFLOP/s)",
    128: "measured faster than cuDNN at shape 14's attention call (481 against 446 TFLOP/s)",
    32: "measured faster than cuDNN and our generic kernel at S=8192 (273 against 220 and 234 TFLOP/s)",
}


def hopper_over_cudnn_min_seq_len(head_dim: int) -> int | None:
    """From which S the planner takes our Hopper kernel over cuDNN at this head_dim (None: never)."""
    if head_dim not in HOPPER_OVER_CUDNN:
        return None
    from ttj_jax.kernels.flash_attention_mgpu import dispatch_min_seq_len  # deferred: Pallas import cost
    return max(CUDNN_MIN_SEQ_LEN, dispatch_min_seq_len(head_dim, fused=True))


# The fused whole-stack kernel up to this many tokens per call (the largest measured: faster than the
# XLA program at shapes 5, 6 and 12) ...
FUSED_STACK_MAX_ROWS = 10000 * 128
# ... and up to this many heads: it walks the heads one after another, and at 16 heads of 8 (shape 11)
# lost to the XLA program (0.303 against 0.221 ms). Beyond it the "rows" stack, measured faster than the
# XLA program there (0.156 against 0.215 ms).
FUSED_STACK_MAX_HEADS = 4
# ... and up to this length, where it was measured (S=32 and 128). At S=256 (16 x 256, d 128, 8 layers) it
# took 0.84 ms against the XLA program's 0.242, and ~35 s to compile
# (bench/results/general-2026-12-03-h200-sub-before.json and -sub-after.json).
FUSED_STACK_PLANNED_MAX_SEQ_LEN = 128
# The "rows" stack for sequences longer than the fused kernel takes, up to this length: at S=1024
# (shape 13) 0.776 ms through the bridge against the XLA program's 1.088.
ROWS_STACK_MAX_SEQ_LEN = 1024
# The Mosaic GPU stack kernel is planned only at the widths it has run on a GPU with: d_model 128 and 32
# (head_dim 8 zero-padded to 16-column blocks).
MGPU_STACK_GPU_VERIFIED_D_MODELS = (32, 128)
# ... and at the head counts where it is the fastest stack: 8 and 16 heads (packed several to a block)
# run correctly but slower (shape 11: 0.226 ms against the rows stack's 0.150), so they are reachable by
# request only (stack="fused_mgpu").
MGPU_STACK_PLANNED_NUM_HEADS = (1, 2, 4)
# For a JAX caller from this length on (shape 2: 88 against the Triton kernel's 126 us); at S=32 the two
# are level on the GPU, and a torch caller still gets the Mosaic kernel there, which the bridge launches
# with ~40 us of host time where the Triton kernel through jax costs ~0.2 ms.
MGPU_STACK_JAX_MIN_SEQ_LEN = 64
# For a torch caller with a prefix mask under causal attention, the rules give the Mosaic kernel (launched
# by the bridge, mask-free, its invalid rows zeroed after it: exact, each valid query sees only earlier,
# valid keys) where they give it without a mask. Measured on the H200 at the harness's --padding-ratio 0.3
# (bench/results/official-2026-12-04-h200-prefix-mask-mosaic.json): 0.079 / 0.066 / 0.079 ms at shapes
# 2 / 7 / 12 against 0.074 / 0.051 / 0.073 unpadded, the peer 0.095 / 0.117 / 0.121. JAX callers keep the
# rules' other stacks; the measured planner times this one beside them.
# For a torch caller with a mask that needs keys masked ("keys": a general mask, a prefix one without
# causal attention; "device": a mask not classified on the host, such as an inference tensor's), the
# rules give the Mosaic kernel's masked build where they give the kernel without a mask, in the builds
# (d_model, num_heads, seq_len, causal) that have run on a GPU with a mask. On the H200 (bench/results/fused-stack-mgpu-2026-12-05-h200-
# holes.json, mask-cost-2026-12-05-h200.json): 0 failed elements with a mask with holes at shapes 2 and 7;
# at shape 7 with an all-True mask it is exact against the mask-free kernel and takes 45.2 us against
# 38.4 (+18%), where the plan it replaces ("rows" through jax, the device deciding) took 126.6; since a
# tile whose tokens are all valid runs the mask-free layers, 41.6 against 38.1 on an H100 (+9%; shape 2
# +4.5%: mask-cost-2026-12-06-h100.json). Shapes 12,
# 9 and 10 (S=32 at 4 heads, 1 and 2 heads at S=128; fused-stack-mgpu-2026-12-05-h200-holes-12-9-10.json):
# 0 failed elements with holes, 81.4 / 50.8 / 62.4 us against 74.2 / 49.2 / 57.5 mask-free, where the
# measured planner's device-deciding plan through jax took 71-102 us of GPU time plus jax's dispatch.
MGPU_STACK_MASKED_PLANNED = True
MGPU_STACK_MASKED_VERIFIED = ((128, 4, 128, True), (32, 4, 128, True), (128, 4, 32, True), (128, 1, 128, True),
                              (128, 2, 128, True))
# x's dtypes the Mosaic stack kernel is planned for: float32, and the half dtypes its builds read and
# write as they are (fused_stack_mgpu.IO_DTYPES), mask-free: on an H100 (2026-12-06) the fp16 builds of
# shapes 1, 7, 9 and 12 and the bf16 builds of 2 and 7 wrote the fp32 build's output rounded to the
# dtype, bit for bit (`fused-stack-mgpu-2026-12-06-h100-*-io-*.json`). Other dtypes are cast to float32
# by the bridge (bridge/direct.py, half_runs_as_float32).
MGPU_STACK_IO_DTYPES = ("float32", "float16", "bfloat16")
# The masked builds reading and writing fp16 x that have run on a GPU (keys as MGPU_STACK_MASKED_VERIFIED):
# on the H200 (2026-12-06, `fused-stack-mgpu-2026-12-06-h200-fp16-holes.json`) shapes 2, 7 and 12 with a
# mask with holes, 0 failed elements, each the fp32 masked build's output rounded. Other half masked
# builds are left to the plans that cast (_masked_build_planned).
MGPU_STACK_MASKED_HALF_VERIFIED = (("float16", 128, 4, 128, True), ("float16", 32, 4, 128, True),
                                   ("float16", 128, 4, 32, True))
MGPU_STACK_ROWS_MASK = ("measured 0.079 / 0.066 / 0.079 ms at shapes 2 / 7 / 12 with padding ratio 0.3, "
                        "against 0.074 / 0.051 / 0.073 without a mask")
# GEMM-bound calls (the one-device XLA program at d_model >= this, S below CUDNN_MIN_SEQ_LEN, unchunked:
# shape 8): q/k/v and the MLP's pre-activation written in fp16 by their GEMMs, every GEMM on cuBLAS
# (XLA's Triton GEMMs off, so cuBLAS fuses the residual adds and the tanh GELU into its epilogues):
# shape 8 1.031 ms against 1.133 (fp16 q/k/v only) and 1.30 (XLA's defaults), worst err/tol 0.65.
GEMM_BOUND_MIN_D_MODEL = 1024
GEMM_BOUND_POLICY = "mixed_fp16_gemm16_tanh"
GEMM_BOUND_XLA_OPTIONS = (("xla_gpu_enable_triton_gemm", False),)
# The three-GEMM q/k/v projection (Plan.qkv_gemms = 3) keeps its three GEMMs apart: XLA's dot merger
# would join GEMMs that share an operand into one and copy the three outputs out of it again. A measured
# candidate beside each cuDNN plan of the GEMM-bound policy: on one H100, 0.402 against 0.425 ms at
# vit-s197, 1.286 against 1.363 at bert-base, 0.272 against 0.278 at clip-text-s77, 0.510 against 0.470
# at dec-l8-d256-hd128, where three small GEMMs lose to one (bench/results/qkv-gemms-2026-12-05-h100.json).
QKV_SPLIT_XLA_OPTIONS = GEMM_BOUND_XLA_OPTIONS + (("xla_disable_hlo_passes", "dot-merger"),)
# The torch peer's own arithmetic as a measured candidate beside each attention's default and GEMM-bound
# plans: q/k/v written in fp16 by their cuBLAS GEMM, the bias added in its epilogue before the one
# rounding (no fp32 [B*S, 3d] tensor and no conversion pass: 18 us per layer at gpt2-s4096 on one H100,
# bench/results/infer-kernels-2026-12-07-h100.json), the MLP's pre-activation in fp32 and the erf GELU.
# Where the GEMM-bound policy's tanh GELU and fp16 pre-activation cost too much accuracy (deep models),
# this one keeps the default policy's: its only extra rounding is the bias's, to fp16.
PEER_NUMERICS_POLICY = "mixed_fp16_qkv16"


@dataclasses.dataclass(frozen=True)
class InputFacts:
    batch_size: int
    seq_len: int
    dtype: str                     # numpy name of x's dtype: "float32", "float16", "bfloat16"
    mask_kind: MaskKind = MaskKind.NONE
    input_devices: int = 1         # devices x is spread over (a sharded jax array); 1 for a torch tensor
    caller: str = "jax"            # "torch": the bridge, which launches Mosaic GPU kernels itself
    # The stacks whose kernels the caller launches itself for this call, without jax's dispatch per call
    # (the bridge: "fused_mgpu" where it launches the Mosaic kernel, "rows" under its Triton launch). The
    # measured planner charges a torch caller's plans through jax the bridge's host time, not these.
    self_launched: tuple[str, ...] = ()

    def __post_init__(self):
        if self.caller not in CALLERS:
            raise ValueError(f"InputFacts.caller={self.caller!r} is not one of {CALLERS}")
        unknown = set(self.self_launched) - set(STACKS)
        if unknown:
            raise ValueError(f"InputFacts.self_launched names {sorted(unknown)}, not stacks of {STACKS}")
        if self.self_launched and self.caller != "torch":
            raise ValueError("InputFacts.self_launched is for a torch caller (the bridge); a jax caller has none")


@dataclasses.dataclass(frozen=True)
class Plan:
    policy: str                    # a name from numerics.POLICIES
    attention: str                 # one of ATTENTION_IMPLEMENTATIONS
    mask_mode: str                 # "none": no masking; "rows": zero invalid rows; "keys": key mask too;
    #                                "device": rows, and keys for the sequences the device finds non-prefix
    batch_chunk: int | None = None  # run the stack over batch chunks of this size (lax.map), or all at once
    data_parallel: int = 1         # devices the batch is split over (parallel.py); chunks are per device
    sequence_parallel: int = 1     # devices each sequence is split over (ring_attention.py)
    reason: str = dataclasses.field(default="", compare=False)   # not part of the plan's identity
    stack: str = "layers"          # one of STACKS
    xla_options: tuple = ()        # ((name, value), ...): XLA compile options for this plan's program
    scan_layers: bool = False      # the layer-by-layer program as one lax.scan over the stacked weights
    # The q/k/v projection in the XLA program: 1, one [d, 3d] GEMM (the fused layout our flash kernel
    # reads); 3, three [d, d] GEMMs, each output dense, for cuDNN's attention, which otherwise gets q, k
    # and v copied out of the fused output (layers.project_qkv, QKV_SPLIT_XLA_OPTIONS).
    qkv_gemms: int = 1

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"Plan.policy={self.policy!r} is not one of {sorted(POLICIES)}")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"Plan.attention={self.attention!r} is not one of {ATTENTION_IMPLEMENTATIONS}")
        if self.mask_mode not in MASK_MODES:
            raise ValueError(f"Plan.mask_mode={self.mask_mode!r} is not one of {MASK_MODES}")
        if self.stack not in STACKS:
            raise ValueError(f"Plan.stack={self.stack!r} is not one of {STACKS}")
        if self.stack != "layers" and (self.policy != "mixed_fp16" or self.batch_chunk):
            raise ValueError(f"Plan.stack={self.stack!r} runs mixed_fp16, unchunked plans only")
        if not isinstance(self.data_parallel, int) or self.data_parallel < 1:
            raise ValueError(f"Plan.data_parallel={self.data_parallel!r} must be an int >= 1")
        if not (isinstance(self.xla_options, tuple)
                and all(isinstance(o, tuple) and len(o) == 2 and isinstance(o[0], str) for o in self.xla_options)):
            raise ValueError(f"Plan.xla_options={self.xla_options!r} must be a tuple of (name, value) pairs")
        if not isinstance(self.sequence_parallel, int) or self.sequence_parallel < 1:
            raise ValueError(f"Plan.sequence_parallel={self.sequence_parallel!r} must be an int >= 1")
        if self.sequence_parallel > 1 and (self.data_parallel > 1 or self.stack != "layers" or self.batch_chunk
                                           or self.attention != "pallas" or self.mask_mode != "none"):
            raise ValueError("Plan.sequence_parallel runs the layer stack with our flash kernel in a ring, "
                             "mask-free, without a batch split or batch chunks")
        if self.xla_options and (self.stack != "layers" or self.data_parallel > 1 or self.sequence_parallel > 1):
            raise ValueError("Plan.xla_options apply to the one-device layer-by-layer XLA program only")
        if self.qkv_gemms not in (1, 3):
            raise ValueError(f"Plan.qkv_gemms={self.qkv_gemms!r} must be 1 or 3")
        if self.qkv_gemms == 3 and (self.stack != "layers" or self.attention != "cudnn"):
            raise ValueError("Plan.qkv_gemms=3 is for the layer-by-layer XLA program with cuDNN's attention "
                             "(the other attentions read the fused q/k/v layout)")
        if self.scan_layers and (self.stack != "layers" or self.sequence_parallel > 1):
            raise ValueError("Plan.scan_layers applies to the layer-by-layer XLA program on one sequence per device")

    @property
    def name(self) -> str:
        if self.stack == "fused":
            return f"fused-stack/{self.policy}/mask-{self.mask_mode}"
        if self.stack == "fused_mgpu":
            return f"fused-stack-mosaic/{self.policy}/mask-{self.mask_mode}"
        if self.stack == "rows":
            return f"row-kernels/{self.attention}-attention/{self.policy}/mask-{self.mask_mode}"
        chunk = f"/chunk{self.batch_chunk}" if self.batch_chunk else ""
        devices = f"/x{self.data_parallel}-devices" if self.data_parallel > 1 else ""
        if self.sequence_parallel > 1:
            devices = f"/ring-x{self.sequence_parallel}-devices"
        options = "/xla-options" if self.xla_options else ""
        scan = "/scan" if self.scan_layers else ""
        qkv = "/qkv3" if self.qkv_gemms == 3 else ""
        return f"{self.attention}-attention/{self.policy}/mask-{self.mask_mode}{chunk}{devices}{scan}{qkv}{options}"

    def explain(self) -> str:
        return f"{self.name}: {self.reason}"


def forward_flop(config: Config, batch: int, seq_len: int) -> float:
    """The forward's useful FLOPs: six GEMMs per token and layer, attention's two (causal: its lower
    triangle)."""
    d, f = config.d_model, config.ffn_dim
    attention = (1 if config.causal else 2) * 2 * seq_len * seq_len * d
    return float(batch * config.num_layers * (2 * seq_len * (4 * d * d + 2 * d * f) + attention))


# The bridge's default for a GPU mask (TTJ_GPU_MASK=auto): the host reads it on every call where the call's
# work makes that host sync cheap: 5 TFLOP is >= ~10 ms on an H100 or H200 (~100 us of sync, the GPU idle
# while the host reads the mask and launches, is then <= ~1%); the device decides elsewhere (MaskKind.UNKNOWN,
# branch-free masked programs: +1% to +10% on the official shapes, measured). Either way no write can make
# the answer stale. Reading lets a long call run its mask-free or prefix plan: the Hopper attention's
# key-masked build runs at 0.75-0.80x its mask-free speed at S >= 4096 (one H100, 2026-12-06).
HOST_MASK_READ_MIN_FLOP = 5e12


def reads_gpu_mask_on_host(config: Config, batch: int, seq_len: int) -> bool:
    """Whether a call of this size reads a GPU mask on the host on every call (TTJ_GPU_MASK=auto)."""
    return forward_flop(config, batch, seq_len) >= HOST_MASK_READ_MIN_FLOP


def launched_by_caller(plan: Plan, inputs: InputFacts) -> bool:
    """Whether the caller runs `plan` by launching its kernels itself, without jax's dispatch per call: its
    stack is one the caller launches (InputFacts.self_launched) on one device. A mask decided on the device
    is read by the kernels themselves (layers.key_mask_for): no work outside them, which the bridge's
    launch would not replay (bridge/triton_launch.py)."""
    return plan.stack in inputs.self_launched and plan.data_parallel == 1


def plan(config: Config, inputs: InputFacts, device: DeviceFacts = CPU, *,
         policy: str | None = None, attention: str | None = None, data_parallel: int | None = None,
         stack: str | None = None, sequence_parallel: int | None = None) -> Plan:
    """Chooses numerics, attention implementation, masking work, devices and chunking for one call
    shape. `policy` / `attention` / `data_parallel` / `stack` / `sequence_parallel` force a choice (tests,
    ablations); the rest is derived."""
    reasons = []
    attention_requested = attention is not None
    policy_requested = policy is not None

    if policy is None:
        policy = "mixed_fp16"
        reasons.append("fp16 GEMMs with fp32 accumulation and fp32 residual meet the harness rule (docs/spec.md) at "
                       "input scales near 1; at 0.25 and below some elements fail: policy mixed_fp16x3 (an exact "
                       "baseline) or tf32 (a TF32 one) there, by name or TTJ_POLICY")
    else:
        reasons.append(f"policy {policy} requested")

    if inputs.mask_kind in (MaskKind.NONE, MaskKind.ALL_TRUE):
        mask_mode = "none"
        reasons.append("no mask work: " + ("no mask" if inputs.mask_kind == MaskKind.NONE else "mask all True"))
    elif inputs.mask_kind == MaskKind.UNKNOWN:
        mask_mode = "device"
        reasons.append("mask not classified on the host: its keys masked and its rows zeroed by the device, "
                       "whatever it holds (no host sync)")
    elif inputs.mask_kind == MaskKind.PREFIX and config.causal:
        mask_mode = "rows"
        reasons.append("prefix mask under causal attention collapses to zeroing invalid rows")
    else:
        mask_mode = "keys"
        reasons.append(f"{inputs.mask_kind.value} mask{'' if config.causal else ' without causal'} "
                       "needs key masking")

    batch_split_why = ""
    if data_parallel is not None:
        reasons.append(f"{data_parallel} device(s) requested")
    else:
        data_parallel, batch_split_why = _data_parallel(config, inputs, device)
    if inputs.batch_size % data_parallel:
        raise ValueError(f"batch {inputs.batch_size} cannot be split evenly over {data_parallel} devices")
    sequence_split_why = ""
    if sequence_parallel is not None:
        if sequence_parallel > 1 and (data_parallel > 1 or stack not in (None, "layers") or mask_mode != "none"
                                      or attention not in (None, "pallas")):
            raise ValueError("sequence_parallel needs no batch split, the 'layers' stack, our 'pallas' "
                             f"attention and no mask work; got data_parallel={data_parallel}, stack={stack}, "
                             f"attention={attention}, mask mode {mask_mode}")
        if inputs.seq_len % (2 * sequence_parallel):
            raise ValueError(f"seq_len {inputs.seq_len} must be a multiple of 2 * sequence_parallel = "
                             f"{2 * sequence_parallel} (two zigzag chunks per device)")
        sequence_split_why = f"sequence split over {sequence_parallel} device(s) requested"
    elif data_parallel == 1 and attention is None and stack is None and not policy_requested:
        sequence_parallel, sequence_split_why = _sequence_parallel(config, inputs, device, mask_mode)
    else:
        sequence_parallel = 1
    # When the sequence splits, the batch split's reason (why the batch stays on one device) does not apply.
    reasons += [why for why in (batch_split_why if sequence_parallel == 1 else "", sequence_split_why) if why]
    if sequence_parallel > 1:   # the ring's own path: our flash kernel per chunk pair, each device S/n tokens
        return Plan(policy=policy, attention="pallas", mask_mode=mask_mode, sequence_parallel=sequence_parallel,
                    reason="; ".join(reasons))

    cudnn_fits = device.takes_cudnn_attention and cudnn_takes_head_dim(config.head_dim, masked=False)
    if attention is not None:
        reasons.append(f"attention {attention} requested")
    elif not device.is_gpu:
        attention = "xla"
        reasons.append("XLA attention on the CPU (Pallas GPU kernels run there only interpreted)")
    elif POLICIES[policy].gemm_dtype == np.float32:   # our kernels and cuDNN's take fp16 operands
        attention = "xla"
        reasons.append(f"fp32-operand attention through XLA ({policy})")
    elif (mask_mode in ("none", "rows") and device.is_hopper
          and (hopper_from := hopper_over_cudnn_min_seq_len(config.head_dim)) is not None
          and inputs.seq_len >= hopper_from):
        attention = "pallas"
        reasons.append(f"S={inputs.seq_len} >= {hopper_from}, head_dim {config.head_dim} on sm_90: our Hopper "
                       f"flash kernel, {HOPPER_OVER_CUDNN[config.head_dim]}")
    elif inputs.seq_len >= CUDNN_MIN_SEQ_LEN and mask_mode in ("none", "rows") and cudnn_fits:
        attention = "cudnn"
        reasons.append(f"S={inputs.seq_len} >= {CUDNN_MIN_SEQ_LEN}: cuDNN's fused attention, measured "
                       "fastest at long sequences (412 against our 346 TFLOP/s at S=16384)")
    elif not config.causal and mask_mode == "none" and cudnn_fits:
        attention = "cudnn"
        reasons.append(f"S={inputs.seq_len}, not causal, no key mask: cuDNN's fused attention, {CUDNN_NON_CAUSAL}")
    else:
        attention = "pallas"
        if not device.takes_cudnn_attention:
            where = f"here (cuDNN's attention needs sm_80 or newer, this is sm_{device.compute_capability})"
        elif inputs.seq_len >= CUDNN_MIN_SEQ_LEN or mask_mode in KEY_MASK_MODES or not cudnn_fits:
            where = "here (key mask or head_dim)"
        else:
            where = "on causal calls up to S=1024 (the official shapes)"
        reasons.append(f"S={inputs.seq_len}: our Pallas flash kernel, measured faster than XLA and cuDNN {where}")


    per_device = dataclasses.replace(inputs, batch_size=inputs.batch_size // data_parallel)
    batch_chunk = _batch_chunk(config, per_device, device, attention)
    if batch_chunk:
        reasons.append(f"activations exceed {ACTIVATION_MEMORY_SHARE:.0%} of device memory: "
                       f"batch chunks of {batch_chunk}")
    if stack == "rows":
        if not _rows_stack_fits(config, inputs):
            raise ValueError(f"stack 'rows' needs d_model and ffn_dim powers of two (d_model <= 128) and "
                             f"batch * seq_len a multiple of {ROWS_BLOCK}; got {config}, "
                             f"{inputs.batch_size}x{inputs.seq_len}")
        if attention != "pallas":
            reasons.append("attention: our Pallas kernel, which the rows stack runs between its row kernels")
        attention = "pallas"
    if stack is not None:
        reasons.append(f"stack {stack} requested")
    elif attention_requested:
        stack = "layers"
    else:
        stack, why = _stack(config, per_device, device, policy, mask_mode, batch_chunk)
        if why:
            reasons.append(why)
    if stack == "fused_mgpu":
        from ttj_jax.kernels import fused_stack_mgpu
        if not fused_stack_mgpu.supports(config, inputs.seq_len, masked=mask_mode in KEY_MASK_MODES) \
                or inputs.dtype not in MGPU_STACK_IO_DTYPES:
            model = fused_stack_mgpu.model_error(config.d_model, config.num_heads, config.ffn_dim)
            raise ValueError(f"stack 'fused_mgpu' needs a model it builds ({model or 'this one is'}), seq_len in "
                             f"{fused_stack_mgpu.SUPPORTED_SEQ_LENS}, shared memory for its layers and x in "
                             f"{MGPU_STACK_IO_DTYPES}; got {config}, S={inputs.seq_len}, {inputs.dtype}")
    if stack in ("fused", "fused_mgpu"):   # the kernel computes attention itself
        attention = "pallas"
    xla_options = ()
    if (not policy_requested and stack == "layers" and device.is_gpu and not batch_chunk and data_parallel == 1
            and config.d_model >= GEMM_BOUND_MIN_D_MODEL and inputs.seq_len < CUDNN_MIN_SEQ_LEN):
        policy, xla_options = GEMM_BOUND_POLICY, GEMM_BOUND_XLA_OPTIONS
        reasons.append(f"GEMM-bound (d_model {config.d_model}, S={inputs.seq_len}): q/k/v and the MLP's "
                       "pre-activation written in fp16 by their GEMMs, every GEMM on cuBLAS with the residual "
                       "adds, and the tanh GELU, in its epilogue, measured 1.031 against 1.133 ms (q/k/v "
                       "only) and 1.30 (XLA's defaults) at shape 8")
    return Plan(policy=policy, attention=attention, mask_mode=mask_mode, batch_chunk=batch_chunk,
                data_parallel=data_parallel, reason="; ".join(reasons), stack=stack, xla_options=xla_options)


# The measured planner (autotune.py) times at most this many candidates per input signature, the
# rules' plan first: each costs one compilation (~1-3 s on the H200) and a few milliseconds of runs.
# (6 until the peer-numerics candidates: two more, one per attention that takes a call at most, with
# the two attentions most calls have.)
MAX_CANDIDATES = 8
# From this depth the XLA-program alternatives are timed as one lax.scan over the layers (one layer's
# body to compile, at any depth): at 8 layers, six unrolled programs compiling side by side left four
# uncompiled after the 15 s budget, in two runs on the H200 (dec-l8-d256-hd128,
# bench/results/general-2026-12-03-h200-final4.json). The rules' plan itself stays unrolled, and its
# scanned twin is timed beside it; with the cheaper compiles, up to MAX_SCANNED_CANDIDATES in all.
SCAN_MIN_LAYERS = 6
MAX_SCANNED_CANDIDATES = 8
# A scanned program runs slower than its unrolled twin (dec-l8-d256-hd128 on one H100: the rules' plan
# 0.688 ms scanned against 0.538 unrolled, general-2026-12-05-h100-qkv3.json; 0.801 against 0.587 in
# general-2026-12-07-h100-subset.json), so at depth the unrolled twins of the scanned cuBLAS plans (the
# alternatives that win on GPU-bound models), cuDNN's first (with cuBLAS, the cheapest unrolled
# compiles), are timed too, queued right after the rules' plan and its scanned twin: where they compile
# within the budget, the program a call would run is the one measured. (Until 2026-12-07 only cuDNN's twins, so a
# model whose key mask or head_dim keeps cuDNN out, dec-l8-d256-hd128, had no unrolled alternative: its
# unrolled GEMM-bound program took 0.39 ms against the rules' plan's 0.49, decisions.md.)
UNROLLED_TWINS_AT_DEPTH = 3
# XLA's explicit-softmax attention is a candidate only while its [B, H, S, S] fp32 scores stay this small.
XLA_ATTENTION_MAX_SCORE_BYTES = 256 * 2**20


def candidates(config: Config, inputs: InputFacts, device: DeviceFacts = CPU) -> list[Plan]:
    """The plans the measured planner may time for this call, the rules' plan (`plan`) first, then the
    alternatives in the order the rules prefer them: the other stacks that take the call, then the
    layer-by-layer XLA program with each attention implementation that takes it, in the default numerics,
    in the GEMM-bound variant (fp16 q/k/v and MLP pre-activation, tanh GELU in cuBLAS's epilogue) and in
    the peer's (fp16 q/k/v written by cuBLAS, PEER_NUMERICS_POLICY).
    Only one-device, unchunked calls on a GPU have alternatives; elsewhere the rules' plan is the only one.
    At most MAX_CANDIDATES; from SCAN_MIN_LAYERS layers on, the XLA-program alternatives scanned over the
    layers, the rules' plan's scanned twin among them, at most MAX_SCANNED_CANDIDATES, and the unrolled
    twins of the scanned cuBLAS plans, cuDNN's first (UNROLLED_TWINS_AT_DEPTH), queued after the rules'
    plan and its scanned twin."""
    prior = plan(config, inputs, device)
    if not device.is_gpu or prior.data_parallel > 1 or prior.sequence_parallel > 1 or prior.batch_chunk:
        return [prior]
    found = [prior]
    scanned = config.num_layers >= SCAN_MIN_LAYERS
    limit = MAX_SCANNED_CANDIDATES if scanned else MAX_CANDIDATES
    unrolled: dict[Plan, Plan] = {}   # each scanned candidate found -> the unrolled plan it was made from

    def add(candidate: Plan | None) -> None:
        if candidate is not None and scanned and candidate.stack == "layers":
            given = candidate
            candidate = dataclasses.replace(candidate, scan_layers=True,
                                            reason=f"{candidate.reason}; the layers as one lax.scan")
            unrolled[candidate] = given
        if candidate is not None and candidate not in found and len(found) < limit:
            found.append(candidate)

    if prior.stack == "layers":
        add(prior)   # its scanned twin, where the depth asks for one (else already found)

    def forced(**choice) -> Plan | None:
        try:
            chosen = plan(config, inputs, device, data_parallel=1, **choice)
        except ValueError:   # the choice does not take this call
            return None
        return chosen if not chosen.batch_chunk else None

    stacks = [s for s in ("fused_mgpu", "fused", "rows") if s != prior.stack]
    # (the Mosaic kernel's masked build, for key masking, only in the builds that have run on a GPU: a
    # first launch of a new build can deadlock or fault, which no timing budget catches in process;
    # bench/fused_stack_mgpu_check.py --mask probes it in a child process first)
    if (not device.is_hopper or inputs.dtype not in MGPU_STACK_IO_DTYPES
            or (prior.mask_mode in KEY_MASK_MODES and not _masked_build_planned(config, inputs))):
        stacks.remove("fused_mgpu")
    from ttj_jax.kernels import fused_stack
    if not fused_stack.supports(config, inputs.seq_len) and "fused" in stacks:
        stacks.remove("fused")
    for stack in stacks:
        add(forced(stack=stack))
    attentions = ["pallas"]
    if device.takes_cudnn_attention and cudnn_takes_head_dim(config.head_dim, prior.mask_mode in KEY_MASK_MODES):
        attentions.append("cudnn")   # (a key mask in extra lanes of q and k: layers.cudnn_attention)
    if 4 * inputs.batch_size * config.num_heads * inputs.seq_len ** 2 <= XLA_ATTENTION_MAX_SCORE_BYTES:
        attentions.append("xla")
    for attention in attentions:
        base = forced(attention=attention)
        if base is None:
            continue
        default = dataclasses.replace(base, policy="mixed_fp16", xla_options=(),
                                      reason=f"{base.reason}; numerics mixed_fp16")
        gemm_bound = dataclasses.replace(base, policy=GEMM_BOUND_POLICY, xla_options=GEMM_BOUND_XLA_OPTIONS,
                                         reason=f"{base.reason}; numerics {GEMM_BOUND_POLICY} with cuBLAS GEMMs")
        for candidate in ((gemm_bound, default) if base.policy == GEMM_BOUND_POLICY else (default, gemm_bound)):
            add(candidate)   # (a plan equal to one found, its reason aside, is not added twice)
        if attention == "cudnn" and gemm_bound.stack == "layers" and gemm_bound.sequence_parallel == 1:
            add(dataclasses.replace(gemm_bound, qkv_gemms=3, xla_options=QKV_SPLIT_XLA_OPTIONS,
                                    reason=f"{gemm_bound.reason}; q, k and v by three GEMMs"))
        if base.stack == "layers":
            add(dataclasses.replace(base, policy=PEER_NUMERICS_POLICY, xla_options=GEMM_BOUND_XLA_OPTIONS,
                                    reason=f"{base.reason}; numerics {PEER_NUMERICS_POLICY} (the peer's) with "
                                           "cuBLAS GEMMs"))
    if scanned:
        cublas = [unrolled[p] for p in found if p in unrolled and p.xla_options]
        twins = [p for p in cublas if p.attention == "cudnn"] + [p for p in cublas if p.attention != "cudnn"]
        twins = [p for p in twins if p not in found][:UNROLLED_TWINS_AT_DEPTH]
        # queued right after the rules' plan and its scanned twin (found[1] where the rules give the layer
        # stack: add(prior) above): their compiles are the long ones, and the candidates compile in this
        # order (autotune.measure)
        first = 2 if prior.stack == "layers" else 1
        found = found[:first] + twins + found[first:]
    return found


def _masked_build_planned(config: Config, inputs: InputFacts) -> bool:
    """Whether the Mosaic kernel's masked build may be planned for this model and length: switched on, and
    a build that has run on a GPU with a mask: MGPU_STACK_MASKED_VERIFIED for float32 x,
    MGPU_STACK_MASKED_HALF_VERIFIED for a half x the kernel reads as it is."""
    build = (config.d_model, config.num_heads, inputs.seq_len, bool(config.causal))
    if not MGPU_STACK_MASKED_PLANNED or build not in MGPU_STACK_MASKED_VERIFIED:
        return False
    return inputs.dtype == "float32" or (inputs.dtype, *build) in MGPU_STACK_MASKED_HALF_VERIFIED


def _rows_stack_fits(config: Config, inputs: InputFacts) -> bool:
    """Whether the "rows" stack's kernels take this model (row_block.supports) and these rows (whole
    tiles of ROWS_BLOCK)."""
    from ttj_jax.kernels import row_block  # limits of the kernels (pure)
    return row_block.supports(config) and (inputs.batch_size * inputs.seq_len) % ROWS_BLOCK == 0


def _stack(config: Config, inputs: InputFacts, device: DeviceFacts, policy: str, mask_mode: str,
           batch_chunk) -> tuple[str, str]:
    """For one device's share of the batch (`inputs`): on Hopper, for mask-free fp32 calls it takes, the
    Mosaic GPU whole-stack kernel (MGPU_STACK_JAX_MIN_SEQ_LEN); else the fused whole-stack kernel where it
    is measured faster than the XLA program (FUSED_STACK_MAX_ROWS, FUSED_STACK_MAX_HEADS); beyond its
    sequence length, the "rows" stack (ROWS_STACK_MAX_SEQ_LEN); the layer-by-layer XLA program otherwise.
    The last two kernels take any mask (they mask keys and zero rows)."""
    from ttj_jax.kernels import fused_stack, fused_stack_mgpu  # limits of the kernels (pure)
    if not (device.is_gpu and policy == "mixed_fp16" and not batch_chunk):
        return "layers", ""
    rows = inputs.batch_size * inputs.seq_len
    # A prefix mask under causal attention ("rows") leaves every valid row as the unmasked stack computes
    # it: the Mosaic kernel runs mask-free and the invalid rows are zeroed after it (MGPU_STACK_ROWS_MASK).
    launched = (inputs.caller == "torch" and inputs.seq_len <= fused_stack_mgpu.TILE_ROWS
                and inputs.batch_size % (fused_stack_mgpu.TILE_ROWS // inputs.seq_len) == 0)
    masked = mask_mode in KEY_MASK_MODES
    mask_ok = (mask_mode == "none" or (mask_mode == "rows" and launched)
               or (masked and launched and _masked_build_planned(config, inputs)))
    if (device.is_hopper and mask_ok and inputs.dtype in MGPU_STACK_IO_DTYPES and rows <= FUSED_STACK_MAX_ROWS
            and config.d_model in MGPU_STACK_GPU_VERIFIED_D_MODELS and config.num_heads in MGPU_STACK_PLANNED_NUM_HEADS
            and fused_stack_mgpu.supports(config, inputs.seq_len, masked=masked)):
        why = ""
        if masked:
            why = (f"S={inputs.seq_len}, a mask that needs its keys masked"
                   + (" (decided in the kernel)" if mask_mode == "device" else "")
                   + ", on sm_90, called from torch: the Mosaic GPU kernel's masked build, "
                   "launched by the bridge without JAX dispatch (a tile whose tokens are all valid runs "
                   "the mask-free layers)")
        elif mask_mode == "rows":
            why = (f"S={inputs.seq_len}, a prefix mask (its invalid rows zeroed after the kernel), "
                   "on sm_90, called from torch: the Mosaic GPU whole-stack kernel launched by "
                   f"the bridge without JAX dispatch, as without a mask ({MGPU_STACK_ROWS_MASK})")
        elif inputs.seq_len >= MGPU_STACK_JAX_MIN_SEQ_LEN:
            why = (f"{inputs.batch_size}x{inputs.seq_len} tokens, no mask, on sm_90: the whole "
                   "stack as one Mosaic GPU kernel, measured faster than the Triton one (88 "
                   "against 126 us at shape 2)")
        elif launched:
            # (a batch that does not fill the kernel's 128-row tiles is padded by the jax path, which the
            # bridge would then have to take: the Triton kernel is faster there)
            why = (f"S={inputs.seq_len}, no mask, on sm_90, called from torch: the Mosaic GPU "
                   "whole-stack kernel launched by the bridge without JAX dispatch (on the GPU "
                   "about as fast as the Triton kernel at S=32, 75 against 78 us, and that "
                   "one pays the jax call's host time)")
        if why:
            if inputs.dtype != "float32":
                why += (f"; x read and written in {inputs.dtype} by the kernel itself, no casts around it "
                        "(+0.2% / +1.8% against float32 x at shapes 1 / 7)")
            return "fused_mgpu", why
    if fused_stack.supports(config, inputs.seq_len):
        if rows > FUSED_STACK_MAX_ROWS:
            return "layers", ""
        if config.num_heads > FUSED_STACK_MAX_HEADS:
            if _rows_stack_fits(config, inputs):
                return "rows", (f"{config.num_heads} heads: more than the fused kernel walks well; per layer "
                                "our flash kernel and one row-tile kernel, measured faster than the XLA "
                                "program at 16 heads of 8 (shape 11: 0.156 against 0.215 ms)")
            return "layers", ""
        if inputs.seq_len > FUSED_STACK_PLANNED_MAX_SEQ_LEN:
            return "layers", ""
        return "fused", (f"{inputs.batch_size}x{inputs.seq_len} tokens fit the fused whole-stack kernel: one "
                         f"launch instead of the XLA program's ~50 kernels, measured faster up to "
                         f"{FUSED_STACK_MAX_ROWS} tokens")
    if (inputs.seq_len > fused_stack.MAX_SEQ_LEN and inputs.seq_len <= ROWS_STACK_MAX_SEQ_LEN
            and _rows_stack_fits(config, inputs)):
        return "rows", (f"S={inputs.seq_len}: per layer our flash kernel and one row-tile kernel for the rest "
                        "(one pass over the fp32 residual instead of ~8), measured faster than the XLA "
                        "program at S=1024 (0.78 against 1.09 ms)")
    return "layers", ""


def _data_parallel(config: Config, inputs: InputFacts, device: DeviceFacts) -> tuple[int, str]:
    """(devices to split the batch over, why; "" where there is one device only). Several when the call is
    large enough to gain, the batch divides over them, and x lives on them (a sharded jax array) or comes
    from the bridge (see DATA_PARALLEL_MIN_ELEMENTS)."""
    if not device.is_gpu or device.device_count < 2:
        return 1, ""
    if inputs.batch_size * inputs.seq_len * config.d_model < DATA_PARALLEL_MIN_ELEMENTS:
        return 1, (f"one device: under {DATA_PARALLEL_MIN_ELEMENTS >> 20}M elements per call a split does "
                   "not pay for its launches")
    if inputs.input_devices > 1:
        n = min(inputs.input_devices, device.device_count)
        where = f"the {n} devices x lives on"
    elif inputs.caller == "torch":
        n = min(SPLIT_FROM_ONE_DEVICE_MAX, device.device_count)
        where = f"{n} devices, x's slices moved by peer-to-peer copies (measured 1.74x at shape 6 on two H200s)"
    else:
        return 1, "one device: x lives on one, and jax moving half of it was measured slower"
    if inputs.batch_size % n:
        return 1, f"one device: batch {inputs.batch_size} does not split evenly over {n} devices"
    return n, f"batch split over {where} (SPMD)"


def _sequence_parallel(config: Config, inputs: InputFacts, device: DeviceFacts, mask_mode: str) -> tuple[int, str]:
    """(devices to split each sequence over, why; "" where that is not considered): a JAX caller's long
    mask-free sequence on one of several GPUs (see SEQUENCE_PARALLEL_MIN_LEN)."""
    if not device.is_gpu or device.device_count < 2 or inputs.caller != "jax" or inputs.input_devices > 1:
        return 1, ""
    if inputs.seq_len < SEQUENCE_PARALLEL_MIN_LEN or inputs.batch_size > SEQUENCE_PARALLEL_MAX_BATCH:
        return 1, ""
    n = min(SPLIT_FROM_ONE_DEVICE_MAX, device.device_count)
    if mask_mode != "none":
        return 1, "one device: the ring is measured mask-free only"
    if inputs.seq_len % (2 * n):
        return 1, f"one device: S={inputs.seq_len} does not split into {2 * n} equal zigzag chunks"
    return n, (f"one long sequence: split over {n} devices, attention as a ring of k/v blocks with our flash "
               f"kernel (measured 1.70x at S=100000 and 1.87x at S=1,000,000 on two H200s)")


def activation_bytes_per_sequence(config: Config, seq_len: int, attention: str) -> int:
    """Peak live activations for one sequence through one layer, fp32, counted generously:
    the residual, the QKV projection, the context, the MLP hidden, plus explicit scores for XLA."""
    d, f, h = config.d_model, config.ffn_dim, config.num_heads
    per_token = 4 * (2 * d + 3 * d + d + 2 * f)
    scores = 4 * 2 * h * seq_len * seq_len if attention == "xla" else 0
    return per_token * seq_len + scores


def _batch_chunk(config: Config, inputs: InputFacts, device: DeviceFacts, attention: str) -> int | None:
    if device.memory_bytes is None:
        return None
    budget = ACTIVATION_MEMORY_SHARE * device.memory_bytes
    per_sequence = activation_bytes_per_sequence(config, inputs.seq_len, attention)
    if per_sequence * inputs.batch_size <= budget:
        return None
    # The largest divisor of the batch that fits: a divisor keeps the chunked reshape free (no padding copy).
    fitting = [c for c in range(1, inputs.batch_size + 1)
               if inputs.batch_size % c == 0 and c * per_sequence <= budget]
    return max(fitting) if fitting else 1


def streaming_chunk(config: Config, inputs: InputFacts, device: DeviceFacts) -> int:
    """Sequences per chunk when x streams from host memory: three chunks in flight (one arriving, one
    computing, one leaving) plus one chunk's activations within the activation share of device memory.
    Without a memory reading (the CPU), a quarter of the batch, so the pipeline still has stages."""
    if device.memory_bytes is None:
        return max(1, inputs.batch_size // 4)
    itemsize = 2 if inputs.dtype in ("float16", "bfloat16") else 4
    attention = "xla" if not device.is_gpu else "pallas"
    per_sequence = (activation_bytes_per_sequence(config, inputs.seq_len, attention)
                    + 3 * 2 * itemsize * inputs.seq_len * config.d_model)
    fitting = int(ACTIVATION_MEMORY_SHARE * device.memory_bytes // per_sequence)
    return max(1, min(inputs.batch_size, fitting))
