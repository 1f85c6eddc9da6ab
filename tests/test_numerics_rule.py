"""The harness rule in jax (ttj_jax.numerics.harness_check) against the torch replica's
(bench.baseline.check_close): same failing count and worst ratio, including the cases that tell
max(atol, rtol |ref|) apart from atol + rtol |ref|, and non-finite values."""

import math

import jax.numpy as jnp
import numpy as np
import torch

from bench.baseline import check_close
from ttj_jax.numerics import HARNESS_ATOL, HARNESS_RTOL, harness_check


def _both(out, ref):
    failed, worst, err = harness_check(jnp.asarray(out), jnp.asarray(ref))
    return (int(failed), float(worst), float(err)), check_close(torch.from_numpy(out), torch.from_numpy(ref))


def test_constants_are_the_harness_replicas():
    from bench import baseline
    assert (HARNESS_ATOL, HARNESS_RTOL) == (baseline.ATOL, baseline.RTOL)


def test_max_not_sum_of_tolerances():
    # |ref| = 0.2: tolerance max(0.002, 0.004) = 0.004; the sum rule would allow 0.006
    ref = np.full(4, 0.2, np.float32)
    out = ref + np.array([0.003, 0.0039, 0.005, -0.0055], np.float32)
    (failed, worst, err), (t_failed, t_worst) = _both(out, ref)
    assert failed == t_failed == 2
    assert math.isclose(worst, t_worst, rel_tol=1e-4) and math.isclose(worst, 0.0055 / 0.004, rel_tol=1e-3)
    assert math.isclose(err, 0.0055, rel_tol=1e-3)
    # near zero the absolute floor rules: 0.0019 passes, 0.0021 fails
    (failed, _, _), (t_failed, _) = _both(np.array([0.0019, 0.0021], np.float32), np.zeros(2, np.float32))
    assert failed == t_failed == 1


def test_non_finite_values_fail_with_infinite_ratio():
    out = np.array([np.nan, 1.0, np.inf, 0.0], np.float32)
    ref = np.array([0.0, np.inf, np.inf, 0.0], np.float32)
    (failed, worst, err), (t_failed, t_worst) = _both(out, ref)
    assert failed == t_failed == 3 and worst == t_worst == math.inf and err == math.inf


def test_random_data_agrees_with_the_torch_replica():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(64, 257)).astype(np.float32) * rng.choice([1e-3, 1.0, 30.0], size=(64, 257))
    out = (ref + rng.normal(size=ref.shape) * 0.01 * np.abs(ref) + rng.normal(size=ref.shape) * 5e-4).astype(np.float32)
    (failed, worst, _), (t_failed, t_worst) = _both(out, ref)
    assert failed == t_failed and failed > 0   # the noise is sized so that some elements fail
    assert math.isclose(worst, t_worst, rel_tol=1e-5)
