"""What bounds the CUDA partial kernel (kernels/decode_attention.cu) at a context length: its loads, its
arithmetic, or the bytes of its scales. Edited copies of the kernel run in place of the library's inside
`kvq bench kernels`' replayed decode step (4 layers' caches back to back), each timed as the full step
(partials and reduce: the CUDA partial kernel maps the query itself) and as the partial kernel alone
(LaunchConfig.kernels):

    python benchmarks/attention_bounds.py --context 32768 131072

- loads only: each warp's tiles are copied into its ring and awaited, but no tile's arithmetic runs (the
  output is wrong);
- arithmetic only: the tiles are computed from whatever the rings hold, no copy is issued (wrong output);
- fp16 scales: the shipped kernel built for fp16 scales (8 bytes per token per role, not 16), on caches whose
  scales are the fp32 ones rounded to fp16. Its output is checked against the fp32 build's on those same
  rounded scales held as fp32.
"""

import argparse
import dataclasses

import torch
from attention_timeline import edited_source

from kvq.bench import attention_step, time_per_layer
from kvq.kernels import decode_attention
from kvq.kernels.decode_attention import PackedKV

LOOP_ANCHOR = "        uint t0 = start + KVQ_TILE * (warp + KVQ_WARPS * i);\n"
ISSUE_ANCHOR = ("__device__ __forceinline__ void kvq_issue_tile(const kvq_copy_plan& plan, uint stage, uint i, "
                "uint t0, uint end) {\n")
# The conditions below never hold for a real launch; they keep the compiler from proving the code after dead.
LOADS_ONLY = [(LOOP_ANCHOR, LOOP_ANCHOR + "        if (t0 != 0xFFFFFFFFu) continue;\n")]
WHOLE_ISSUE_ANCHOR = ("__device__ __forceinline__ void kvq_issue_whole_tile(const kvq_copy_plan& plan, uint stage, "
                      "uint i) {\n")
ARITHMETIC_ONLY = [(ISSUE_ANCHOR, ISSUE_ANCHOR + "    if (end != 0xFFFFFFFFu) return;\n"),
                   (WHOLE_ISSUE_ANCHOR, WHOLE_ISSUE_ANCHOR + "    if (i != 0xFFFFFFFFu) return;\n")]
VARIANTS = {"shipped": ([], torch.float32), "loads only": (LOADS_ONLY, torch.float32),
            "arithmetic only": (ARITHMETIC_ONLY, torch.float32), "fp16 scales": ([], torch.float16)}
PIECES = {"step": ("map", "partial", "reduce"), "partial alone": ("partial",)}


def with_scales(caches, dtype: torch.dtype) -> list[tuple[PackedKV, PackedKV]]:
    return [tuple(PackedKV(p.codes, p.scales.to(dtype), p.bits, p.head_dim) for p in layer) for layer in caches]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda")
    builds = {name: decode_attention.build_cuda_partial(
        decode_attention.cuda_partial_source(torch.float16, scale_dtype, edited_source(edits)), device)
        for name, (edits, scale_dtype) in VARIANTS.items()}
    default = decode_attention.LAUNCH
    for tokens in args.context:
        _, caches, _, step = attention_step("cuda", tokens, 32, 8, 128, 32)
        inputs = {name: caches for name in VARIANTS}
        inputs["fp16 scales"] = with_scales(caches, torch.float16)
        outputs = {}
        for name in ("shipped", "fp16 scales"):
            decode_attention._cuda_partial_kernel = lambda dtype, scales, device, build=builds[name]: build
            rounded = with_scales(inputs["fp16 scales"], torch.float32) if name == "shipped" else inputs[name]
            outputs[name] = step(*rounded[0]).float()
        print(f"T={tokens}: fp16 scales against the shipped kernel on the same rounded scales, max abs "
              f"{(outputs['shipped'] - outputs['fp16 scales']).abs().max().item():.3e}")
        for round_index in range(args.repeats):
            for name, build in builds.items():
                decode_attention._cuda_partial_kernel = lambda dtype, scales, device, build=build: build
                times = []
                for label, kernels in PIECES.items():
                    decode_attention.LAUNCH = dataclasses.replace(default, kernels=kernels)
                    times.append(f"{label} {time_per_layer(step, inputs[name], 'cuda') * 1e6:.2f}")
                decode_attention.LAUNCH = default
                print(f"T={tokens} round {round_index} {name}: " + ", ".join(times) + " us", flush=True)


if __name__ == "__main__":
    main()
