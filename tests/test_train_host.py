"""bench.train_host: its sampler times each part alone (its setup outside the span), and its CPU smoke run
writes every part of the training step."""

import json
import time

from bench import train_host


def test_drained_samples_time_the_part_not_its_setup():
    order = []
    parts = {"slow": (lambda: time.sleep(0.004), lambda _: time.sleep(0.002)),
             "fast": (None, lambda _: order.append("fast"))}
    medians = train_host.drained_samples_us(parts, 5, sync=lambda: order.append("sync"))
    assert 2000 <= medians["slow"] < 3800      # the 4 ms setup is outside the span
    assert medians["fast"] < 1000
    assert order.count("fast") == 5 and order.count("sync") == 11   # drained before every sample and at the end


def test_cpu_smoke_run_records_every_part(tmp_path):
    assert train_host.main(["--device", "cpu", "--calls", "2", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("train-host-*.json")
    record = json.loads(path.read_text())["configs"]["cpu-2"]
    for part in ("step", "forward", "inputs", "forward_jax", "export_y", "backward", "apply_jax", "to_torch",
                 "optimizer", "b2b_step", "gpu_step"):
        assert record[f"{part}_us"] > 0, part
    arrays = record["arrays"]
    # the forward's own inputs among the residuals are handed back, not returned (training.Residuals)
    assert arrays["forward_outputs"] + arrays["forwarded"] == arrays["apply_inputs"] and arrays["forward_inputs"] > 30
    assert arrays["forwarded"] > 10
    assert train_host.main(["--device", "cpu", "--configs", "no-such-config"]) == 2
