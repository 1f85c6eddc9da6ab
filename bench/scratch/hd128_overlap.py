"""head_dim 128: the one-accumulator overlap (MgpuBlockSizes(128, 2, 2, overlap_softmax=True,
overlap_one_accumulator=True)) against the default, checked, then timed at several lengths, twice in
alternating order (bench_attention_mgpu's steps and JSON).

    PYTHONPATH=. python3 bench/scratch/hd128_overlap.py OUT_DIR
"""
import datetime
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import jax  # noqa: E402
import bench.bench_attention_mgpu as bam  # noqa: E402
from bench.report import slug  # noqa: E402

OVL = dict(block_sizes=bam.Blocks(128, 2, 2, overlap_softmax=True, overlap_one_accumulator=True))


def main(out_dir):
    device = jax.devices()[0]
    date = datetime.date.today().isoformat()
    header = {"gpu": device.device_kind, "jax": jax.__version__, "date": date,
              "command": "PYTHONPATH=. python3 bench/scratch/hd128_overlap.py OUT", "pass_rule": "atol 0.002, rtol 0.02"}
    run = bam.Run(pathlib.Path(out_dir) / f"attention-mgpu-{date}-{slug(device.device_kind)}-hd128-overlap.json",
                  header, 90.0, 400.0)
    for causal in (True, False):
        for seq_len in (113, 1000):
            bam._check(run, 2, 3, seq_len, 128, causal, kernel_kwargs=OVL)
    bam._check(run, 1, 2, 16384, 128, True, kernel_kwargs=OVL)
    for case in ((1, 16, 16384, 128), (4, 16, 4096, 128), (1, 16, 32768, 128)):
        bam._time_case(run, *case, variants=[{}, OVL], baselines=case[2] == 16384)
        bam._time_case(run, *case, variants=[OVL, {}], baselines=False)
    bam._print_table(run)
    run.write()
    return 1 if any(c["passed"] is False for c in run.checks) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
