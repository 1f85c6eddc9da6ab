"""ptxas's report (registers, spills, wgmma serialization warnings) for Mosaic GPU attention builds.

    PYTHONPATH=. python3 bench/scratch/ptxas_dump.py OUT_DIR [NAME,NAME,...]   (default: every variant)

Each variant compiles in its own process with MOSAIC_GPU_DUMP_PTXAS / MOSAIC_GPU_DUMP_SASS set and its
dump in OUT_DIR/<name>/; prints, per variant, ptxas's lines about registers, spills and wgmma, and SASS
instruction counts of interest. Needs the GPU (the compile happens at the first call).
"""
import json
import os
import pathlib
import subprocess
import sys

VARIANTS = {
    "hd64_default": "dict()",
    "hd64_half_exp2": "dict(block_sizes=B(128, 4, 3, half_exp2=True))",
    # session 15: fewer instructions per score (MgpuBlockSizes.prescaled_q / half_row_sum)
    "hd64_prescaled_q": "dict(block_sizes=B(128, 4, 3, prescaled_q=True))",
    "hd64_half_row_sum": "dict(block_sizes=B(128, 4, 3, half_row_sum=True))",
    "hd64_prescaled_q_half_row_sum": "dict(block_sizes=B(128, 4, 3, prescaled_q=True, half_row_sum=True))",
    "hd64_deferred_row_sum": "dict(block_sizes=B(128, 4, 3, deferred_row_sum=True))",
    "hd64_deferred_sum_tree_max": "dict(block_sizes=B(128, 4, 3, deferred_row_sum=True, tree_row_max=True))",
    # session 16: conditional rescaling (MgpuBlockSizes.lazy_rescale)
    "hd64_lazy_rescale": "dict(block_sizes=B(128, 4, 3, lazy_rescale=True))",
    "hd64_persistent": "dict(block_sizes=B(128, 4, 3, persistent=True))",
    # session 18: Q as the register operand of Q @ K^T (MgpuBlockSizes.q_in_registers)
    "hd64_q_in_registers": "dict(block_sizes=B(128, 4, 3, q_in_registers=True))",
    "hd64_ovl3_one_acc": "dict(block_sizes=B(128, 4, 3, overlap_softmax=True, overlap_one_accumulator=True))",
    "hd128_default": "dict()",
    "hd128_ovl2_one_acc": "dict(block_sizes=B(128, 2, 2, overlap_softmax=True, overlap_one_accumulator=True))",
    # the Mosaic whole-stack kernel (ttj_jax/kernels/fused_stack_mgpu.py) at official shapes
    "stack_shape2": "dict(shape='2')",
    "stack_shape1": "dict(shape='1')",
    "stack_shape12": "dict(shape='12')",
    "stack_shape7": "dict(shape='7')",
    # session 14: the residual as the out-projection's / MLP-out's accumulator (residual_accumulator)
    "stack_shape2_resacc": "dict(shape='2', residual_accumulator=True)",
    "stack_shape2_overlap_resacc": "dict(shape='2', overlap=True, residual_accumulator=True)",
    "stack_shape6": "dict(shape='6')",
    "stack_shape6_resacc": "dict(shape='6', residual_accumulator=True)",
    "stack_shape2_pipeline": "dict(shape='2', pipeline=True)",
    # session 23: 16 heads of 8 packed four to a block (shape 11), sub-heads one at a time or side by side
    "stack_shape11": "dict(shape='11')",
    "stack_shape11_group2": "dict(shape='11', head_group=2)",
    "stack_shape1_group2": "dict(shape='1', head_group=2)",
}

CHILD = r"""
import importlib, sys, jax, jax.numpy as jnp
fm = importlib.import_module("ttj_jax.kernels.flash_attention_mgpu")
B = fm.MgpuBlockSizes
kwargs = eval(sys.argv[2])
if "shape" in kwargs:
    options = {k: v for k, v in kwargs.items() if k != "shape"}
    import ttj_jax as T
    fsm = importlib.import_module("ttj_jax.kernels.fused_stack_mgpu")
    shape = T.OFFICIAL[kwargs["shape"]]
    c = shape.config
    weights = fsm.stack_weights_mgpu(T.init_params(jax.random.key(0), c), c.num_heads)
    x = jnp.ones((c.batch_size, c.seq_len, c.d_model), jnp.float32)
    fsm.fused_stack_mgpu_forward(weights, x, num_heads=c.num_heads, causal=True, **options).block_until_ready()
else:
    hd = int(sys.argv[1])
    q = jnp.ones((1, 4096, 2, hd), jnp.float16)
    fm.flash_attention_mgpu(q, q, q, causal=True, **kwargs).block_until_ready()
print("compiled")
"""


def _tool(name):
    import glob, shutil  # noqa: PLC0415
    found = shutil.which(name)
    if found:
        return found
    for pattern in (f"/usr/local/cuda*/bin/{name}", f"{sys.prefix}/lib/python3*/site-packages/nvidia/*/bin/{name}",
                    f"/usr/lib/python3*/*-packages/nvidia/*/bin/{name}", f"/usr/local/lib/python3*/*-packages/nvidia/*/bin/{name}"):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def disassemble(dump: pathlib.Path) -> str:
    """SASS of the dumped PTX: ptxas to a cubin, then nvdisasm or cuobjdump; '' where the tools are missing.
    Also writes the spill sites (STL/LDL with context) to dump/spills.txt."""
    ptxas, nvdisasm, cuobjdump = _tool("ptxas"), _tool("nvdisasm"), _tool("cuobjdump")
    print(f"   tools: ptxas={ptxas} nvdisasm={nvdisasm} cuobjdump={cuobjdump}")
    ptx = dump / "entry_0.ptx"
    if not (ptxas and ptx.exists() and (nvdisasm or cuobjdump)):
        return ""
    cubin = dump / "entry_0.cubin"
    done = subprocess.run([ptxas, "-arch=sm_90a", "-O3", "-v", str(ptx), "-o", str(cubin)], capture_output=True, text=True)
    print("   own ptxas:", (done.stdout + done.stderr).strip().replace("\n", " | ")[-400:])
    if done.returncode:
        return ""
    tool = [nvdisasm, "-c", str(cubin)] if nvdisasm else [cuobjdump, "-sass", str(cubin)]
    sass = subprocess.run(tool, capture_output=True, text=True).stdout
    (dump / "entry_0.sass").write_text(sass)
    lines = sass.splitlines()
    sites = []
    for i, line in enumerate(lines):
        if "STL" in line or "LDL" in line:
            sites.append("\n".join(lines[max(0, i - 3):i + 2]))
    (dump / "spills.txt").write_text("\n----\n".join(sites))
    return sass


def opcode_histogram(sass: str) -> dict:
    """Static count of each SASS opcode (the mnemonic before its first '.', predicates dropped), most
    frequent first: what the softmax's per-score instructions compile to (FFMA or FMUL + FADD, ...)."""
    import collections, re  # noqa: PLC0415, E401
    counts = collections.Counter()
    for match in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass):
        counts[match.group(1)] += 1
    return dict(counts.most_common())


def main(out_dir: str, only: str = "") -> int:
    out = pathlib.Path(out_dir)
    summary = {}
    names = only.split(",") if only else list(VARIANTS)
    unknown = set(names) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {list(VARIANTS)}")
    for name in names:
        kwargs = VARIANTS[name]
        dump = out / name
        dump.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_SASS="1", MOSAIC_GPU_DUMP_TO=str(dump))
        hd = name[2:name.index("_")] if name.startswith("hd") else "0"
        done = subprocess.run([sys.executable, "-c", CHILD, hd, kwargs, name], env=env, capture_output=True, text=True,
                              timeout=300)
        text = done.stdout + done.stderr
        for f in sorted(dump.iterdir()):
            if f.is_file() and "ptxas" in f.name:
                text += f.read_text(errors="replace")
        lines = [line.strip() for line in text.splitlines()
                 if any(w in line.lower() for w in ("register", "spill", "wgmma", "serializ", "warning", "error"))]
        sass = disassemble(dump)
        counts = {op: sass.count(op) for op in ("HGMMA", "WARPGROUP.DEPBAR", "WARPGROUP.ARRIVE", "MUFU.EX2",
                                                "STL", "LDL", "BAR.SYNC", "SYNCS", "USETMAXREG")}
        summary[name] = {"rc": done.returncode, "ptxas": lines[:40], "sass_counts": counts,
                         "opcodes": opcode_histogram(sass), "files": sorted(f.name for f in dump.iterdir())}
        print(f"== {name} rc={done.returncode} files={summary[name]['files']}")
        for line in lines[:20]:
            print("  ", line[:200])
        print("   sass:", counts)
        if done.returncode:
            print(done.stderr[-2000:])
    (out / "ptxas-summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
