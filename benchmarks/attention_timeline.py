"""When each program of the CUDA partial kernel (kernels/decode_attention.cu) starts, is released by the
kernel before it (the previous layer's reduce), ends its tile loop and writes its partial, inside `kvq bench
kernels`' replayed decode steps.

    python benchmarks/attention_timeline.py --context 32768 131072

A copy of the kernel is built with %globaltimer reads (in the timer.s own steps) stored per program; the
graph-replayed step of `kvq bench kernels` (4 layers' caches back to back) then runs it in place of the
library's. Per layer: programs, and minimum / median / maximum (loop ends and ends also the 90th
percentile) in us from the first program's start, over the packed programs; the window program's start.
The gap from one layer's last end to the next layer's release is the reduce kernel between them.
"""

import argparse
import math

import torch

from kvq.bench import attention_step, time_per_layer
from kvq.kernels import decode_attention
from kvq.kernels.backends import CudaLaunch
from kvq.kernels.source import KERNEL_DIR

STAMPS = 8  # per program: start, released, 4 warps' loop ends, end, unused
MAX_SPLITS = 256  # splits per (batch, KV head) the stamp buffers hold (a 132-SM plan at 32 query / 8 KV heads: 65)
TIMER = ('__device__ __forceinline__ unsigned long long kvq_now() { unsigned long long t; '
         'asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }\n')
EDITS = [  # (anchor in kernels/decode_attention.cu, what replaces it)
    ("typedef unsigned int uint;", "typedef unsigned int uint;\n" + TIMER),
    ("float scale, uint device_lengths) {",
     "float scale, uint device_lengths, unsigned long long* trace) {\n"
     f"    unsigned long long* stamps = trace + {STAMPS} * (blockIdx.y * gridDim.x + blockIdx.x);\n"
     "    if (threadIdx.x == 0) stamps[0] = kvq_now();"),
    ("    kvq_await_previous_kernel();\n    kvq_map_query(",
     "    kvq_await_previous_kernel();\n    if (threadIdx.x == 0) stamps[1] = kvq_now();\n    kvq_map_query("),
    ('    asm volatile("cp.async.wait_all;" ::: "memory");\n',
     '    asm volatile("cp.async.wait_all;" ::: "memory");\n'
     "    if (threadIdx.x % 32 == 0) stamps[2 + warp] = kvq_now();\n"),
    ("    if (x == 0) {\n        maxima[stat] = top * KVQ_LN2;",
     "    if (x == 0) stamps[6] = kvq_now();\n    if (x == 0) {\n        maxima[stat] = top * KVQ_LN2;"),
    ("uint n_splits, uint split,\n    float scale) {",
     "uint n_splits, uint split,\n    float scale, unsigned long long* stamps) {"),
    ("start, end, bh, gqa, capacity, gridDim.y, split, scale);",
     "start, end, bh, gqa, capacity, gridDim.y, split, scale, stamps);"),
]


def edited_source(edits: list[tuple[str, str]]) -> str:
    """kernels/decode_attention.cu with each (anchor, replacement) applied; every anchor must occur once."""
    source = (KERNEL_DIR / "decode_attention.cu").read_text()
    for anchor, replacement in edits:
        if source.count(anchor) != 1:
            raise SystemExit(f"kernels/decode_attention.cu changed: update the edits for {anchor!r}")
        source = source.replace(anchor, replacement)
    return source


class TimedKernel:
    """The timed build, launched with the next layer's stamp buffer appended to its arguments."""

    def __init__(self, kernel: CudaLaunch, buffers: list[torch.Tensor]):
        self.kernel, self.buffers, self.launches = kernel, buffers, 0
        self.resident_blocks = kernel.resident_blocks

    def __call__(self, grid, args, programmatic=False):
        buffer = self.buffers[self.launches % len(self.buffers)]
        self.launches += 1
        self.kernel(grid, [*args, buffer], programmatic=programmatic)


def percentiles(values: list[int], at=(0.0, 0.5, 1.0)) -> str:
    ordered = sorted(values)
    return "/".join(f"{ordered[int(p * (len(ordered) - 1))] / 1e3:.2f}" for p in at)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, nargs="+", default=[32768])
    args = parser.parse_args()
    source = edited_source(EDITS)
    for tokens in args.context:
        _, caches, _, step = attention_step("cuda", tokens, 32, 8, 128, 32)
        window_programs = math.prod(caches[0][0].codes.shape[:2])  # the grid's last row: batch x KV heads
        buffers = [torch.zeros(STAMPS * window_programs * MAX_SPLITS, dtype=torch.int64, device="cuda")
                   for _ in caches]
        built = {}

        def timed_kernel(dtype, scale_dtype, device, buffers=buffers, built=built):
            if (dtype, scale_dtype) not in built:
                timed = decode_attention.cuda_partial_source(dtype, scale_dtype, source)
                built[dtype, scale_dtype] = TimedKernel(decode_attention.build_cuda_partial(timed, device), buffers)
            return built[dtype, scale_dtype]

        decode_attention._cuda_partial_kernel = timed_kernel
        steps = [time_per_layer(step, caches, "cuda") * 1e6 for _ in range(3)]
        print(f"T={tokens}: step " + " / ".join(f"{t:.2f}" for t in steps) + " us (the last replay's stamps):")
        layers = [b.view(-1, STAMPS).cpu() for b in buffers]  # kept from the last graph replay
        origin = min(int(stamps[stamps[:, 0] > 0, 0].min()) for stamps in layers)
        for index, stamps in enumerate(layers):
            stamps = stamps[stamps[:, 0] > 0] - origin
            packed = stamps[:-window_programs]
            print(f"  layer {index}: programs {stamps.shape[0]}; start {percentiles(packed[:, 0].tolist())}; "
                  f"released {percentiles(packed[:, 1].tolist())}; "
                  f"loop done {percentiles(packed[:, 2:6].max(1).values.tolist(), (0.0, 0.5, 0.9, 1.0))}; "
                  f"end {percentiles(packed[:, 6].tolist(), (0.0, 0.5, 0.9, 1.0))}; "
                  f"window start {stamps[-window_programs:, 0].min().item() / 1e3:.2f} us")


if __name__ == "__main__":
    main()
