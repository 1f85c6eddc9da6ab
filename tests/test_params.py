"""Parameters: PyTorch-equivalent init, docs/spec.md's state_dict names both ways, clear errors."""

import jax
import numpy as np
import pytest
import torch

import ttj_jax as T
from bench.baseline import BaselineTransformer, TransformerConfig

CONFIG = T.Config(2, 8, 64, 4, 96, 3, True)


def test_init_matches_pytorch_defaults():
    params = T.init_params(jax.random.key(0), CONFIG)
    flat = T.params_to_state_dict(params)
    assert list(flat) == list(BaselineTransformer(TransformerConfig(**vars(CONFIG))).state_dict())
    for name, value in flat.items():
        value = np.asarray(value)
        if "norm" in name:
            assert (value == (1.0 if name.endswith("weight") else 0.0)).all(), name
        else:   # nn.Linear: weight and bias ~ U(-1/sqrt(in), 1/sqrt(in))
            fan_in = flat[name.rsplit(".", 1)[0] + ".weight"].shape[1]
            bound = 1 / np.sqrt(fan_in)
            assert np.abs(value).max() <= bound and np.abs(value).max() > 0.8 * bound, name
            assert abs(value.mean()) < 0.2 * bound, name


def test_state_dict_round_trip_from_torch_and_numpy():
    torch.manual_seed(0)
    state = BaselineTransformer(TransformerConfig(**vars(CONFIG))).state_dict()
    for source in (state, {k: v.numpy() for k, v in state.items()}):
        back = T.params_to_state_dict(T.params_from_state_dict(source, CONFIG))
        assert list(back) == list(state)
        for name in state:
            np.testing.assert_array_equal(np.asarray(back[name]), state[name].numpy())
    inferred = T.params_from_state_dict(state)              # without a config: read off names and shapes
    assert len(inferred["layers"]) == CONFIG.num_layers


def test_state_dict_errors_name_what_is_wrong():
    state = BaselineTransformer(TransformerConfig(**vars(CONFIG))).state_dict()
    missing = {k: v for k, v in state.items() if k != "layers.1.ffn_in.bias"}
    with pytest.raises(ValueError, match=r"missing \['layers.1.ffn_in.bias'\]"):
        T.params_from_state_dict(missing, CONFIG)
    with pytest.raises(ValueError, match="unexpected"):
        T.params_from_state_dict({**state, "extra.weight": state["final_norm.weight"]}, CONFIG)
    wrong = dict(state, **{"layers.0.attention.q_proj.weight": torch.zeros(64, 32)})
    with pytest.raises(ValueError, match=r"q_proj.weight.*shape \(64, 32\), expected \(64, 64\)"):
        T.params_from_state_dict(wrong, CONFIG)
    ints = dict(state, **{"final_norm.bias": torch.zeros(64, dtype=torch.int32)})
    with pytest.raises(ValueError, match="floating dtype"):
        T.params_from_state_dict(ints, CONFIG)


def test_host_arrays_go_to_the_default_device(monkeypatch):
    """On a GPU machine a numpy or CPU-torch state_dict must land on the GPU: imported zero-copy as it is,
    it stays CPU-committed and drags the forward onto the CPU. Here the default
    backend is made to look like a GPU and the move is recorded."""
    import jax
    import numpy as np
    import torch

    from ttj_jax.params import to_jax_array
    moved = []
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "device_put", lambda a, d: moved.append(d) or a)
    for value in (np.arange(6, dtype=np.float32), torch.arange(6, dtype=torch.bfloat16),
                  torch.ones(6, requires_grad=True)):
        out = to_jax_array(value)
        assert out.shape == (6,)
    assert len(moved) == 3
    monkeypatch.undo()
    assert to_jax_array(np.ones(3, np.float32)).devices() == {jax.devices()[0]}   # the CPU here: no copy needed
