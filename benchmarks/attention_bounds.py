"""What bounds the CUDA partial kernel (kernels/decode_attention.cu) at a context length: its loads, its
arithmetic, or the bytes of its scales. Edited copies of the kernel run in place of the library's inside
`kvq bench kernels`' replayed decode step (4 layers' caches back to back), each timed as the full step
(map, partials, reduce) and as the partial kernel alone (LaunchConfig.kernels):

    python benchmarks/attention_bounds.py --context 32768 131072

- loads only: each warp's tiles are copied into its ring and awaited, but no tile's arithmetic runs (the
  output is wrong);
- arithmetic only: the tiles are computed from whatever the rings hold, no copy is issued (wrong output);
- fp16 scales: K and V scales read as fp16 (8 bytes per token per role, not 16) from caches whose scales are
  the fp32 ones rounded to fp16. Its output is checked against the shipped kernel's on those same rounded
  scales held as fp32.
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
ARITHMETIC_ONLY = [(ISSUE_ANCHOR, ISSUE_ANCHOR + "    if (end != 0xFFFFFFFFu) return;\n")]
# Lanes 0-7 copy the K scales of tokens 2 (lane % 8) and + 1 (16 bytes), lanes 8-15 the V scales; lanes 16-31
# copy what lanes 0-15 do (one request per sector either way).
FP16_SCALES = [
    ("#define KVQ_SCALES_BYTES (KVQ_TILE * KVQ_GROUPS * 4)", "#define KVQ_SCALES_BYTES (KVQ_TILE * KVQ_GROUPS * 2)"),
    ("    const float* scales;  // lanes 0-15: K scales of token lane; 16-31: V scales of token lane - 16",
     "    const ushort* scales;"),
    ("    plan.scale_token = lane % KVQ_TILE;", "    plan.scale_token = 2 * (lane % 8);"),
    ("    plan.scales = (lane < KVQ_TILE ? key_scales : value_scales) + (first_token + plan.scale_token) * KVQ_GROUPS;",
     "    plan.scales = ((lane / 8) % 2 == 0 ? (const ushort*)key_scales : (const ushort*)value_scales) + "
     "(first_token + plan.scale_token) * KVQ_GROUPS;"),
    ("    plan.scale_at = (lane < KVQ_TILE ? KVQ_KS_AT : KVQ_VS_AT) + plan.scale_token * 16;",
     "    plan.scale_at = ((lane / 8) % 2 == 0 ? KVQ_KS_AT : KVQ_VS_AT) + (lane % 8) * 16;"),
    ("    const float* scales = plan.scales + step * KVQ_GROUPS;",
     "    const ushort* scales = plan.scales + step * KVQ_GROUPS;"),
    ("    bool scale_valid = t0 + plan.scale_token < end;",
     "    uint scale_bytes = t0 + plan.scale_token + 1 < end ? 16 : (t0 + plan.scale_token < end ? 8 : 0);"),
    ("    kvq_copy16(stage + plan.scale_at, scale_valid ? scales : scales - plan.scale_token * KVQ_GROUPS,\n"
     "               scale_valid ? 16 : 0);",
     "    kvq_copy16(stage + plan.scale_at, scale_bytes ? scales : scales - plan.scale_token * KVQ_GROUPS, "
     "scale_bytes);"),
    ("                float2 k_scale = *(const float2*)(tile + KVQ_KS_AT + token * 16 + 8 * (r / 4));\n"
     "                v_scale[2 * n + e] = *(const float2*)(tile + KVQ_VS_AT + token * 16 + 8 * (r / 4));",
     "                float2 k_scale = kvq_half2_pair(*(const uint*)(tile + KVQ_KS_AT + token * 8 + 4 * (r / 4)));\n"
     "                v_scale[2 * n + e] =\n"
     "                    kvq_half2_pair(*(const uint*)(tile + KVQ_VS_AT + token * 8 + 4 * (r / 4)));"),
    ("__device__ __forceinline__ float kvq_exp2(float x) {",
     "__device__ __forceinline__ float2 kvq_half2_pair(uint pair) {\n"
     "    float low, high;\n"
     '    asm("{ .reg .f16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }"\n'
     '        : "=f"(low), "=f"(high) : "r"(pair));\n'
     "    return make_float2(low, high);\n"
     "}\n\n"
     "__device__ __forceinline__ float kvq_exp2(float x) {"),
]
VARIANTS = {"shipped": [], "loads only": LOADS_ONLY, "arithmetic only": ARITHMETIC_ONLY, "fp16 scales": FP16_SCALES}
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
        decode_attention.cuda_partial_source(torch.float16, edited_source(edits)), device)
        for name, edits in VARIANTS.items()}
    default = decode_attention.LAUNCH
    decode_attention.CUDA_PARTIAL_MIN_TOKENS = 0
    for tokens in args.context:
        _, caches, _, step = attention_step("cuda", tokens, 32, 8, 128, 32)
        inputs = {name: caches for name in VARIANTS}
        inputs["fp16 scales"] = with_scales(caches, torch.float16)
        outputs = {}
        for name in ("shipped", "fp16 scales"):
            decode_attention._cuda_partial_kernel = lambda dtype, device, build=builds[name]: build
            rounded = with_scales(inputs["fp16 scales"], torch.float32) if name == "shipped" else inputs[name]
            outputs[name] = step(*rounded[0]).float()
        print(f"T={tokens}: fp16 scales against the shipped kernel on the same rounded scales, max abs "
              f"{(outputs['shipped'] - outputs['fp16 scales']).abs().max().item():.3e}")
        for round_index in range(args.repeats):
            for name, build in builds.items():
                decode_attention._cuda_partial_kernel = lambda dtype, device, build=build: build
                times = []
                for label, kernels in PIECES.items():
                    decode_attention.LAUNCH = dataclasses.replace(default, kernels=kernels)
                    times.append(f"{label} {time_per_layer(step, inputs[name], 'cuda') * 1e6:.2f}")
                decode_attention.LAUNCH = default
                print(f"T={tokens} round {round_index} {name}: " + ", ".join(times) + " us", flush=True)


if __name__ == "__main__":
    main()
