"""Fused quantize time against the number of vectors, in waves (the vectors an SM array holds at once:
SMs x 384 threads, one vector per thread), to split a run into a per-wave rate and a fixed cost.

    python benchmarks/quantize_sizes.py

SRFT and identity per-token int4, d=128, fp16 input; CUDA-graph replays as `kvq bench kernels`, best of 3.
Also times a device copy of the same bytes, and the quantize call four times per replay on distinct
inputs.
"""

import torch

from kvq import ops
from kvq.bench.kernels import quantize_bytes
from kvq.bench.timing import peak_bandwidth, time_call
from kvq.quant.layout import PackedLayout
from kvq.quant.rotated import RotatedQuantizer
from kvq.quant.scalar import ScalarQuantizer
from kvq.rotations import SRFT, Identity

D = 128
BENCH_VECTORS = 262144
THREADS_PER_SM = 384  # three 128-thread blocks (the kernel's launch bounds)


def moved_bytes(vectors: int) -> int:
    return quantize_bytes(vectors, PackedLayout(D, 4, D))  # per-token int4: one float32 scale


def best_us(fn, replays: int = 3) -> float:
    return min(time_call(fn, "cuda", graph=True, repeats=30) for _ in range(replays)) * 1e6


def main() -> None:
    peak = peak_bandwidth("cuda")
    wave = torch.cuda.get_device_properties(0).multi_processor_count * THREADS_PER_SM
    for name, rotation in (("srft", SRFT(D, 0)), ("identity", Identity(D))):
        quantizer = RotatedQuantizer(rotation, ScalarQuantizer(4, "per_token"))
        for vectors in [wave * k for k in range(1, 7)] + [BENCH_VECTORS, 1 << 20]:
            x = torch.randn(vectors, D, device="cuda", dtype=torch.float16)
            us = best_us(lambda q=quantizer, x=x: ops.encode(q, x))
            print(f"{name} {vectors} vectors ({vectors / wave:.2f} waves): {us:.2f} us, "
                  f"{moved_bytes(vectors) / (us * 1e-6) / peak:.1%} of peak")
        inputs = [torch.randn(BENCH_VECTORS, D, device="cuda", dtype=torch.float16) for _ in range(4)]
        us = best_us(lambda q=quantizer, xs=inputs: [ops.encode(q, x) for x in xs]) / len(inputs)
        print(f"{name} {BENCH_VECTORS} vectors, 4 distinct inputs per replay: {us:.2f} us per call, "
              f"{moved_bytes(BENCH_VECTORS) / (us * 1e-6) / peak:.1%} of peak")
    source = torch.empty(moved_bytes(BENCH_VECTORS) // 2, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    us = best_us(lambda: target.copy_(source))
    print(f"copy of {moved_bytes(BENCH_VECTORS)} bytes moved: {us:.2f} us, "
          f"{moved_bytes(BENCH_VECTORS) / (us * 1e-6) / peak:.1%} of peak")


if __name__ == "__main__":
    main()
