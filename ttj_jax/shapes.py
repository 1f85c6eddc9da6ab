"""The one table of shapes, shared by tests, benchmarks and the CLI.

`OFFICIAL` holds the fourteen official harness shapes (docs/spec.md, all causal).
`CPU_SMALL` holds CPU-sized versions of them: the same head_dim, d_model/ffn ratio and regime, with
batch and sequence cut down so the whole suite runs in seconds without a GPU.
`GENERAL` holds configurations shaped like real encoders and decoders (`ttj-bench --suite general`):
B 1-64, S 32-8192, d_model 128-2048, head_dim 32-128, ffn 1-4x d_model, 1-8 layers, causal or not,
all-True or padded masks, float32 or float16 inputs.
"""

from __future__ import annotations

import dataclasses

from ttj_jax.config import Config


@dataclasses.dataclass(frozen=True)
class Shape:
    id: str
    config: Config
    regime: str
    # the harness's --padding-ratio: prefix masks with lengths in [round(S*(1-p)), S] (0: all-True)
    padding: float = 0.0
    # the harness's --dtype: model and input in this dtype, checked against the baseline in it
    dtype: str = "float32"
    # the harness's --input-scale: x = randn * input_scale
    input_scale: float = 1.0

    def describe(self) -> str:
        c = self.config
        text = (f"B={c.batch_size} S={c.seq_len} d={c.d_model} H={c.num_heads} "
                f"ffn={c.ffn_dim} L={c.num_layers} causal={c.causal}")
        if self.padding:
            text += f" padding={self.padding}"
        if self.dtype != "float32":
            text += f" dtype={self.dtype}"
        if self.input_scale != 1.0:
            text += f" input_scale={self.input_scale:g}"
        return text


def _shape(id, B, S, d, H, ffn, L, regime, causal=True, padding=0.0, dtype="float32") -> Shape:
    return Shape(id, Config(batch_size=B, seq_len=S, d_model=d, num_heads=H, ffn_dim=ffn,
                            num_layers=L, causal=causal), regime, padding=padding, dtype=dtype)


OFFICIAL: dict[str, Shape] = {s.id: s for s in [
    _shape("1", 64, 128, 128, 4, 128, 4, "launch/latency"),
    _shape("2", 1, 128, 128, 4, 128, 4, "launch-bound"),
    _shape("3", 4, 128, 128, 4, 128, 4, "launch-bound"),
    _shape("4", 16, 128, 128, 4, 128, 4, "launch-bound"),
    _shape("5", 128, 128, 128, 4, 128, 4, "mixed"),
    _shape("6", 10000, 128, 128, 4, 128, 4, "memory-bound"),
    _shape("7", 64, 128, 32, 4, 32, 4, "launch-bound, head_dim 8"),
    _shape("8", 64, 128, 1024, 4, 1024, 4, "GEMM-bound, head_dim 256"),
    _shape("9", 64, 128, 128, 1, 128, 4, "head_dim 128"),
    _shape("10", 64, 128, 128, 2, 128, 4, "head_dim 64"),
    _shape("11", 64, 128, 128, 16, 128, 4, "head_dim 8"),
    _shape("12", 64, 32, 128, 4, 128, 4, "launch-bound, S=32"),
    _shape("13", 64, 1024, 128, 4, 128, 4, "attention-bound"),
    _shape("14", 32, 100000, 1024, 16, 1024, 2, "beyond one device"),
]}

# Shapes 1-13 are the ones the harness (and its baseline) can run; 14 needs the scale tooling.
HARNESS_IDS: tuple[str, ...] = tuple(str(i) for i in range(1, 14))

# CPU-sized twins: head_dim, the regime's character and the layer count kept, sizes cut.
CPU_SMALL: dict[str, Shape] = {s.id: s for s in [
    _shape("cpu-1", 4, 128, 128, 4, 128, 4, "official 1, batch cut"),
    _shape("cpu-2", 1, 128, 128, 4, 128, 4, "official 2 as is"),
    _shape("cpu-7", 4, 128, 32, 4, 32, 4, "official 7 (head_dim 8), batch cut"),
    _shape("cpu-8", 2, 64, 512, 2, 512, 2, "official 8 (head_dim 256), cut"),
    _shape("cpu-9", 4, 128, 128, 1, 128, 2, "official 9 (head_dim 128), cut"),
    _shape("cpu-11", 4, 128, 128, 16, 128, 2, "official 11 (head_dim 8), cut"),
    _shape("cpu-12", 8, 32, 128, 4, 128, 4, "official 12 (S=32), batch cut"),
    _shape("cpu-13", 2, 256, 128, 4, 128, 2, "official 13 (attention-bound), cut"),
]}

# Real-model-shaped configs. Each baseline's [B, H, S, S] fp32 scores stay at or under ~2.1 GB (8192^2 x 8
# heads) and its call at a few ms on an H200.
GENERAL: dict[str, Shape] = {s.id: s for s in [
    # encoders (non-causal)
    _shape("bert-base", 32, 512, 768, 12, 3072, 2, "BERT-base-like encoder", causal=False),
    _shape("enc-tiny-s32", 64, 32, 128, 4, 512, 4, "tiny encoder, head_dim 32", causal=False),
    _shape("enc-mini-s64", 64, 64, 256, 4, 1024, 4, "mini encoder", causal=False),
    _shape("enc-small-s128", 64, 128, 256, 8, 512, 4, "small encoder, head_dim 32, ffn 2x", causal=False),
    _shape("vit-s197", 64, 197, 384, 6, 1536, 2, "ViT-S/16-like, odd S", causal=False),
    # decoders (causal)
    _shape("gpt2-s4096", 1, 4096, 768, 12, 3072, 2, "GPT-2-like, long context"),
    _shape("dec-hd128-s8192", 1, 8192, 1024, 8, 4096, 2, "decoder, head_dim 128, S=8192"),
    _shape("dec-d2048", 2, 2048, 2048, 16, 8192, 1, "wide decoder, d=2048, one layer"),
    _shape("clip-text-s77", 64, 77, 512, 8, 2048, 2, "CLIP-text-like, odd S"),
    _shape("dec-hd32-s1024", 8, 1024, 512, 16, 2048, 4, "decoder, head_dim 32"),
    _shape("dec-l8-d128", 16, 256, 128, 4, 128, 8, "8 layers, d=128, ffn 1x"),
    _shape("dec-l8-d256-hd128", 8, 512, 256, 2, 768, 8, "8 layers, head_dim 128, ffn 3x"),
    # padded masks
    _shape("bert-base-pad30", 32, 512, 768, 12, 3072, 2, "BERT-base-like, padding 0.3", causal=False, padding=0.3),
    _shape("enc-s128-pad70", 64, 128, 256, 4, 1024, 2, "small encoder, padding 0.7", causal=False, padding=0.7),
    _shape("gpt2-s1024-pad30", 8, 1024, 768, 12, 3072, 2, "GPT-2-like batch, padding 0.3", padding=0.3),
    _shape("dec-s2048-pad70", 4, 2048, 1024, 16, 4096, 2, "decoder, padding 0.7", padding=0.7),
    # float16 model and input
    _shape("bert-base-fp16", 32, 512, 768, 12, 3072, 2, "BERT-base-like, float16", causal=False, dtype="float16"),
    _shape("gpt2-s1024-fp16", 8, 1024, 768, 12, 3072, 4, "GPT-2-like, float16", dtype="float16"),
    _shape("dec-hd128-fp16-pad30", 4, 2048, 1024, 8, 4096, 2, "decoder, head_dim 128, float16, padding 0.3",
           padding=0.3, dtype="float16"),
]}

SUITES: dict[str, dict[str, Shape]] = {"small": CPU_SMALL, "official": OFFICIAL, "general": GENERAL}


HARNESS_DTYPES = ("float32", "float16", "bfloat16")


def _option_number(option: str, prefix: str, valid, rule: str) -> float:
    """The number after `prefix` in a harness option; ValueError stating `rule` where it is none or not valid."""
    try:
        value = float(option[len(prefix):])
    except ValueError:
        value = float("nan")
    if not valid(value):
        raise ValueError(f"{option!r}: {rule}")
    return value


def with_options(shape: Shape, options: str) -> Shape:
    """`shape` under the harness options named by `options`, "@"-separated: a dtype (the harness's
    --dtype: "float16"), "pad<ratio>" (its --padding-ratio: "pad0.3") and/or "scale<s>" (its
    --input-scale: "scale0.1"); the id gets them as given ("2@float16@pad0.3"). ValueError, naming what is
    accepted, for anything else."""
    dtype, padding, scale = shape.dtype, shape.padding, shape.input_scale
    for option in options.split("@") if options else ():
        if option in HARNESS_DTYPES:
            dtype = option
        elif option.startswith("pad"):
            padding = _option_number(option, "pad", lambda p: 0.0 <= p < 1.0,
                                     "a padding ratio is pad<p> with 0 <= p < 1, as the harness's --padding-ratio (pad0.3)")
        elif option.startswith("scale"):
            scale = _option_number(option, "scale", lambda s: 0.0 < s < float("inf"),
                                   "an input scale is scale<s> with s > 0, as the harness's --input-scale (scale0.1)")
        else:
            raise ValueError(f"{option!r} is not a harness option: a dtype ({', '.join(HARNESS_DTYPES)}), "
                             "pad<p> (the padding ratio, 0 <= p < 1) or scale<s> (the input scale, s > 0)")
    if (dtype, padding, scale) == (shape.dtype, shape.padding, shape.input_scale):
        return shape
    return dataclasses.replace(shape, id=f"{shape.id}@{options}", dtype=dtype, padding=padding, input_scale=scale)


def find(config_id: str) -> Shape:
    """The shape with this id in any suite (ids do not repeat across them), optionally with harness options
    after "@" (with_options): "bert-base", "2@float16", "2@pad0.3". KeyError for an unknown id."""
    name, _, options = config_id.partition("@")
    for suite in SUITES.values():
        if name in suite:
            return with_options(suite[name], options)
    raise KeyError(f"no shape {name!r} in the suites {sorted(SUITES)}")
