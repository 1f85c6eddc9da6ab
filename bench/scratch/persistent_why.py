"""Why is the persistent kernel (MgpuBlockSizes.persistent) slower on long sequences? (session 16)

    PYTHONPATH=. python3 bench/scratch/persistent_why.py OUT_DIR [ROUNDS] [--more | --tiles | --l2 | --only=I,J]

At B=1 H=16 S=100000 head_dim 64 the default and the persistent build, causal and non-causal, timed in
ROUNDS alternating rounds (median of 5 timings of back-to-back calls). Non-causal tiles all cost the
same, so the persistent kernel's static schedule is balanced there by construction (each of the 132
blocks runs 63 or 64 equal tiles): if it still loses there, the cost is per key block (its code), not
the schedule; if it loses only under causal, the static schedule is the suspect.
Writes OUT_DIR/persistent-why-<date>-<gpu>.json.

--tiles (session 17) adds non-causal cases with about as many tiles but 4x and 16x fewer key blocks
per tile (S=25000 with B=4, S=6250 with B=16): a cost per tile shows as a loss growing with 1/blocks
per tile, a cost per key block as the same loss at every S.

--l2 (session 17; run in session 18) adds B=1 H=1 S=100000, non-causal and causal: one head's K and V
(25.6 MB) fit the H200's L2 whole, so every block's loads hit L2 in both builds. If the persistent
build's per-key-block loss (4.1% non-causal at H=16) is about L2 hits under its static assignment, it
should mostly vanish here; if it stays, L2 is not the cause. It stayed (-5.3% non-causal, -1.1%
causal: persistent-why-2026-12-01-nvidia-h200-l2.json); Nsight Compute found the cause in the SASS that
ran (ncu-attention-2026-12-01-nvidia-h200.json; docs/results-log.md, "Attention kernels", session 18).

    PYTHONPATH=. python3 bench/scratch/persistent_why.py --sass DUMPS FILE.json

adds to FILE.json the unmasked main loop's length and its opcode counts that differ between the
default and persistent builds, from the SASS that `bench/scratch/ptxas_dump.py DUMPS
hd64_default,hd64_persistent` wrote (the loop: the first backward branch's body of 400-500
instructions holding 12 HGMMA).
"""
from __future__ import annotations

import datetime
import importlib
import json
import pathlib
import statistics
import sys

import jax
import jax.numpy as jnp

from bench.bench_attention_mgpu import _random_qkv
from bench.jax_timing import stream_ms_per_call
from bench.report import slug, write_json

fm = importlib.import_module("ttj_jax.kernels.flash_attention_mgpu")
B, H, S, HD = 1, 16, 100_000, 64
# (B, H, S, head_dim, causal): the main case both ways, then (with --more) shape 13's and shape 14's
# attention calls and a head_dim-128 one
CASES = [(B, H, S, HD, True), (B, H, S, HD, False)]
MORE_CASES = [(64, 4, 1024, 32, True), (8, 16, 100_000, 64, True), (1, 16, 16384, 128, True)]
# (with --tiles) non-causal, ~8400 tiles of 782 / 196 / 49 key blocks with the second main case
TILE_CASES = [(4, 16, 25_000, 64, False), (16, 16, 6_250, 64, False)]
# (with --l2) one head: its K/V fit in L2 (521 tiles of 192 rows, so the head-major order, as at H=16)
L2_CASES = [(1, 1, 100_000, 64, False), (1, 1, 100_000, 64, True)]


def main_loop(sass: str) -> list[str]:
    """The SASS lines (with their addresses) of the unmasked main loop: the body of the first backward
    branch of 400-500 instructions holding 12 HGMMA."""
    import re  # noqa: PLC0415
    labels, lines = {}, []
    for line in sass.splitlines():
        label = re.match(r"\.L_x_(\d+):", line.strip())
        if label:
            labels[int(label.group(1))] = len(lines)
        elif re.search(r"/\*[0-9a-f]{4,}\*/\s", line):
            lines.append(line)
    for end, text in enumerate(lines):
        branch = re.search(r"BRA\s+`\(\.L_x_(\d+)\)", text)
        start = labels.get(int(branch.group(1)), end + 1) if branch else end + 1
        body = lines[start:end + 1]
        if start <= end and 400 < len(body) < 500 and sum("HGMMA" in x for x in body) == 12:
            return body
    raise ValueError("no main loop found")


def sass_report(dumps: pathlib.Path, path: pathlib.Path):
    from bench.scratch.ptxas_dump import opcode_histogram  # noqa: PLC0415
    loops = {name: main_loop((dumps / name / "entry_0.sass").read_text()) for name in ("hd64_default", "hd64_persistent")}
    counts = {name: opcode_histogram("\n".join(body)) for name, body in loops.items()}
    names = sorted(set(counts["hd64_default"]) | set(counts["hd64_persistent"]))
    result = json.loads(path.read_text())
    result["main_loop"] = {"length": {name: len(body) for name, body in loops.items()},
                           "opcodes_that_differ": {op: [counts["hd64_default"].get(op, 0),
                                                        counts["hd64_persistent"].get(op, 0)]
                                                   for op in names
                                                   if counts["hd64_default"].get(op, 0) != counts["hd64_persistent"].get(op, 0)}}
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["main_loop"]))


def main(argv):
    if argv and argv[0] == "--sass":
        return sass_report(pathlib.Path(argv[1]), pathlib.Path(argv[2]))
    more, tiles, l2 = "--more" in argv, "--tiles" in argv, "--l2" in argv
    only = next((a.split("=", 1)[1] for a in argv if a.startswith("--only=")), None)
    argv = [a for a in argv if a not in ("--more", "--tiles", "--l2") and not a.startswith("--only=")]
    out_dir = pathlib.Path(argv[0])
    rounds = int(argv[1]) if len(argv) > 1 else 3
    builds, inputs = {}, {}
    cases = CASES + (MORE_CASES if more else []) + (TILE_CASES if tiles else []) + (L2_CASES if l2 else [])
    if only:   # --only=I,J: those entries of CASES + MORE_CASES + TILE_CASES + L2_CASES
        cases = [(CASES + MORE_CASES + TILE_CASES + L2_CASES)[int(i)] for i in only.split(",")]
    for case in cases:
        b, h, s, hd, causal = case
        inputs[case] = _random_qkv(s, (b, s, h, hd), jnp.float16)
        default = fm.default_block_sizes(hd, s)
        persistent = fm.persistent_block_sizes(hd, s)
        for name, blocks in (("default", default), ("persistent", persistent)):
            fn = jax.jit(lambda q, k, v, c=causal, bl=blocks: fm.flash_attention_mgpu(q, k, v, causal=c, block_sizes=bl))
            compiled = fn.lower(*inputs[case]).compile()
            jax.block_until_ready(compiled(*inputs[case]))
            builds[(case, name)] = compiled
    samples = {key: [] for key in builds}
    for r in range(rounds):
        for key in (list(builds) if r % 2 == 0 else list(reversed(builds))):
            ms, _ = stream_ms_per_call(builds[key], inputs[key[0]], min_seconds=0.3, repeats=5)
            samples[key].append(ms)
    rows = []
    for ((b, h, s, hd, causal), name), ms in samples.items():
        median = statistics.median(ms)
        rows.append(dict(B=b, H=h, S=s, head_dim=hd, causal=causal, build=name, ms=median, ms_rounds=ms,
                         tflops=fm.attention_flops(b, s, h, hd, causal) / (median * 1e9)))
    device = jax.devices()[0]
    result = dict(gpu=device.device_kind, jax=jax.__version__, date=datetime.date.today().isoformat(),
                  command="PYTHONPATH=. python3 bench/scratch/persistent_why.py OUT " + str(rounds)
                  + (" --more" if more else "") + (" --tiles" if tiles else "") + (" --l2" if l2 else "")
                  + (f" --only={only}" if only else ""), rows=rows)
    path = write_json(result, out_dir, f"persistent-why-{result['date']}-{slug(device.device_kind)}")
    for r in rows:
        print(f"B={r['B']} H={r['H']} S={r['S']} hd={r['head_dim']} {'causal' if r['causal'] else 'full':6s} "
              f"{r['build']:10s} {r['ms']:9.3f} ms {r['tflops']:7.1f} TFLOP/s rounds {['%.3f' % x for x in r['ms_rounds']]}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
