"""`kvq bench kernels`: the fused quantize kernel (ns/vector, GB/s, fraction of the device's HBM bandwidth) against
the torch reference, and fused int4 decode attention (us/step) against SDPA on fp16 K/V and against
dequantize-then-SDPA, at Llama-3-8B-like shapes."""

import torch
import torch.nn.functional as F

from kvq import ops
from kvq.bench.timing import LAYERS, copy_bandwidth, peak_bandwidth, time_call, time_per_layer
from kvq.errors import KvqError
from kvq.quant.layout import PackedLayout
from kvq.quant.packing import pack
from kvq.quant.rotated import RotatedQuantizer
from kvq.quant.scalar import SCALE_DTYPES, ScalarQuantizer
from kvq.quant.turbo import TurboQuant
from kvq.rotations import SRFT, SRHT, Identity


def quantize_bytes(vectors: int, layout: PackedLayout) -> int:
    """Bytes a quantize call moves: fp16 rows in, the layout's packed codes and stats out."""
    return vectors * (layout.head_dim * 2 + layout.code_bytes + layout.stats * layout.stats_dtype.itemsize)


def bench_quantize(device: str, vectors: int = 262144, d: int = 128, group: int = 32) -> list[dict]:
    x = torch.randn(vectors, d, device=device, dtype=torch.float16)
    peak = peak_bandwidth(device)
    rows = []
    calibrated = torch.rand(d) + 0.5

    def scalar(rotation, bits, granularity, lam=None, scale_dtype="float32", symmetric=True):
        return RotatedQuantizer(rotation(d, 0), ScalarQuantizer(bits, granularity, group, symmetric, scale_dtype), lam)

    # The identity and SRHT rows price the rotation: the same staging, abs-max and packing with no transform and
    # with a cheaper one. The 2- and 3-bit rows and TurboQuant_mse's price codes packed as a bit stream (KIVI-2's
    # values are the uint2 row), TurboQuant's its norm and nearest-level search.
    for label, quantizer in (
            ("srft int4 per-token", scalar(SRFT, 4, "per_token")),
            ("srft int4 g32 + lambda", scalar(SRFT, 4, "per_group", calibrated)),
            ("srft int4 g32 + lambda, fp16 scales", scalar(SRFT, 4, "per_group", calibrated, "float16")),
            ("srht int4 per-token", scalar(SRHT, 4, "per_token")),
            ("identity int4 per-token", scalar(Identity, 4, "per_token")),
            ("identity uint2 g32, fp16 scales and offsets", scalar(Identity, 2, "per_group", None, "float16", False)),
            ("srft int3 g32", scalar(SRFT, 3, "per_group")),
            ("TurboQuant_mse-4 (srft, fp16 norm)", TurboQuant(SRFT(d, 0), 4)),
            ("TurboQuant_mse-3 (srft, fp16 norm)", TurboQuant(SRFT(d, 0), 3))):
        # The write and read kernels themselves, on the form's device tensors (a graph captures no host copy).
        form = quantizer.packed_form().on(x.device)
        moved = quantize_bytes(vectors, form.layout)
        fused = time_call(lambda f=form: ops.quantize(x, f), device, graph=True)
        eager = time_call(lambda f=form: ops.quantize(x, f), device)
        reference = time_call(lambda q=quantizer: q.encode(x), device, repeats=5)
        codes, stats = ops.quantize(x, form)
        inverse = time_call(lambda f=form, c=codes, s=stats: ops.dequantize(c, s, f, x.dtype), device, graph=True)
        rows.append({
            "kernel": label, "vectors": vectors, "d": d, "bytes_moved": moved,
            "fused_ns_per_vector": fused / vectors * 1e9, "fused_GBps": moved / fused / 1e9,
            "fraction_of_peak_bandwidth": moved / fused / peak if peak else None,
            "eager_call_us": eager * 1e6, "reference_call_us": reference * 1e6,
            "eager_speedup_vs_reference": reference / eager,
            "inverse_ns_per_vector": inverse / vectors * 1e9, "inverse_GBps": moved / inverse / 1e9,
        })
    return rows


def random_packed(batch: int, heads: int, tokens: int, d: int, bits: int, group: int, device: str,
                  generator: torch.Generator | None = None, scale_dtype: torch.dtype = torch.float32) -> ops.PackedKV:
    """Random codes over +-qmax with scales that give K/V of unit size whatever the width."""
    high = 1 << (bits - 1)
    codes = torch.randint(1 - high, high, (batch, heads, tokens, d), generator=generator)
    scales = (torch.rand(batch, heads, tokens, d // group, generator=generator) * 0.3 + 0.05) * 7 / (high - 1)
    return ops.PackedKV(pack(codes, bits).to(device), scales.to(device, scale_dtype), bits, d)


def packed_layers(tokens: int, kv_heads: int, d: int, group: int, device: str, layers: int = LAYERS,
                  scale_dtype: torch.dtype = torch.float32):
    """(keys, values) packed int4 caches for `layers` layers."""
    return [tuple(random_packed(1, kv_heads, tokens, d, 4, group, device, scale_dtype=scale_dtype) for _ in range(2))
            for _ in range(layers)]


def attention_step(device: str, tokens: int, q_heads: int, kv_heads: int, d: int, group: int,
                   layers: int = LAYERS, scale_dtype: str = "float32") -> tuple:
    """The benched decode attention step: (SRFT int4 quantizer, `layers` packed caches of `tokens` tokens,
    fp16 query (1, q_heads, 1, d), step(keys, values) -> fused attention with an 8-token window). scale_dtype:
    the caches' and the quantizer's scales, as ScalarQuantizer names them."""
    quantizer = RotatedQuantizer(SRFT(d, 0), ScalarQuantizer(4, "per_group", group, scale_dtype=scale_dtype))
    caches = packed_layers(tokens, kv_heads, d, group, device, layers, SCALE_DTYPES[scale_dtype])
    window = torch.randn(1, kv_heads, 8, d, device=device, dtype=torch.float16)
    q16 = torch.randn(1, q_heads, 1, d, device=device, dtype=torch.float16)
    rotation = quantizer.rotation.matrix().to(device)
    query_map = rotation.T.contiguous()

    def step(keys: ops.PackedKV, values: ops.PackedKV) -> torch.Tensor:
        reads = ops.DecodeStep(keys, values, (window, window), query_map, rotation)
        return ops.decode_attention(q16.squeeze(-2), reads, d ** -0.5)

    return quantizer, caches, q16, step


def _attention_row(device: str, tokens: int, q_heads: int, kv_heads: int, d: int, group: int,
                   scale_dtype: str) -> dict:
    quantizer, caches, q16, step = attention_step(device, tokens, q_heads, kv_heads, d, group,
                                                  scale_dtype=scale_dtype)
    fused = time_per_layer(step, caches, device)
    eager = time_call(lambda: step(*caches[0]), device)
    fp16 = [tuple(torch.randn(1, kv_heads, tokens, d, device=device, dtype=torch.float16) for _ in range(2))
            for _ in caches]
    sdpa = time_per_layer(lambda k, v: F.scaled_dot_product_attention(q16, k, v, enable_gqa=True), fp16, device)
    del fp16

    def dequantize_then_sdpa(keys, values):
        k, v = (ops.decode(quantizer, p.as_packed(torch.float16)) for p in (keys, values))
        return F.scaled_dot_product_attention(q16, k, v, enable_gqa=True)

    dequant = time_per_layer(dequantize_then_sdpa, caches, device)
    return {
        "context": tokens, "scales": scale_dtype, "q_heads": q_heads, "kv_heads": kv_heads, "d": d,
        "layers_cycled": len(caches),
        "fused_int4_us": fused * 1e6, "fused_eager_call_us": eager * 1e6, "sdpa_fp16_us": sdpa * 1e6,
        "dequantize_then_sdpa_us": dequant * 1e6,
        "speedup_vs_sdpa_fp16": sdpa / fused, "speedup_vs_dequantize_then_sdpa": dequant / fused,
        "fused_GBps": ops.packed_read_bytes(1, kv_heads, tokens, d, 4, group, SCALE_DTYPES[scale_dtype].itemsize)
        / fused / 1e9,
    }


def bench_attention(device: str, contexts=(1024, 8192, 32768, 131072), q_heads: int = 32, kv_heads: int = 8,
                    d: int = 128, group: int = 32, scale_dtypes=("float32", "float16")) -> list[dict]:
    return [_attention_row(device, tokens, q_heads, kv_heads, d, group, scale_dtype)
            for scale_dtype in scale_dtypes for tokens in contexts]


def bench_kernels(device: str, vectors: int = 262144, contexts=(1024, 8192, 32768, 131072)) -> dict:
    if not device.startswith("cuda") and device != "mps":
        raise KvqError("kvq bench kernels times GPU kernels; run it with --device cuda or mps")
    return {
        "peak_bandwidth_Bps": peak_bandwidth(device), "copy_bandwidth_Bps": copy_bandwidth(device),
        "available": ops.kernel_builds(), "quantize": bench_quantize(device, vectors),
        "attention": bench_attention(device, contexts),
    }
