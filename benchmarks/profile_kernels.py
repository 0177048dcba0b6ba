"""One fused quantize call or one decode attention step (and fp16 SDPA at the same length), warmed up, for
a profiler to measure on its own. Nsight Compute serializes kernels and locks clocks to base, so its
durations run longer than `kvq bench kernels`' graph replays; its counters say what bounds a kernel.

    ncu --section SpeedOfLight --section Occupancy -k kvq_quantize -s 2 -c 1 \
        python benchmarks/profile_kernels.py quantize --rotation srft
    ncu --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
        -k regex:"_map_|_partial_|_reduce_" -s 6 -c 3 python benchmarks/profile_kernels.py attention --context 32768

Shapes are `kvq bench kernels`': 262144 x 128 fp16 vectors, per-token int4; Llama-3-8B attention (32 query /
8 KV heads, d=128) over int4 g32 caches.
"""

import argparse

import torch
import torch.nn.functional as F

from kvq import kernels
from kvq.bench import attention_step
from kvq.quant.rotated import RotatedQuantizer
from kvq.quant.scalar import ScalarQuantizer
from kvq.rotations import SRFT, SRHT, Identity

ROTATIONS = {"srft": SRFT, "srht": SRHT, "identity": Identity}
WARM_CALLS = 3  # calls before the one a profiler skips to: builds, allocations and caches settle


def quantize(rotation: str) -> None:
    quantizer = RotatedQuantizer(ROTATIONS[rotation](128, 0), ScalarQuantizer(4, "per_token"))
    x = torch.randn(262144, 128, device="cuda", dtype=torch.float16)
    for _ in range(WARM_CALLS):
        kernels.encode(quantizer, x)


def attention(context: int) -> None:
    _, caches, query, step = attention_step("cuda", context, q_heads=32, kv_heads=8, d=128, group=32, layers=2)
    for call in range(WARM_CALLS + 1):
        step(*caches[call % 2])
    keys, values = (torch.randn(1, 8, context, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    for _ in range(WARM_CALLS):
        F.scaled_dot_product_attention(query, keys, values, enable_gqa=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kernel", choices=["quantize", "attention"])
    parser.add_argument("--rotation", choices=sorted(ROTATIONS), default="srft")
    parser.add_argument("--context", type=int, default=32768)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    if args.kernel == "quantize":
        quantize(args.rotation)
    else:
        attention(args.context)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
