"""sm_90 SASS of the fused kernels, built without a GPU: registers, shared memory, instruction
counts, and the opcodes of each loop (the offline builds the kernel log in runs/bench/LOG.md cites).

    pip install triton==3.6.0 nvidia-cuda-nvrtc-cu12   # Triton's wheel carries ptxas and nvdisasm
    python benchmarks/offline_sass.py quantize --rotation srft --bits 4 --group 128
    python benchmarks/offline_sass.py attention --stages 4 --warps 2
    python benchmarks/offline_sass.py cuda-attention

`quantize` builds kvq_quantize / kvq_dequantize from kernels/ with NVRTC, as the CUDA backend does (for
fp16 vectors); `attention` builds the Triton decode partial kernel at `kvq bench kernels`' shapes (32 query
/ 8 KV heads, d=128, int4 g32); `cuda-attention` builds kernels/decode_attention.cu, the CUDA partial
kernel that serves those shapes from 16K tokens, for an fp16 query. --out keeps the PTX, cubin and SASS.
"""

import argparse
import collections
import ctypes
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from kvq.kernels.decode_attention import cuda_partial_source
from kvq.kernels.plan import plan_for
from kvq.kernels.source import translation_unit
from kvq.quant.rotated import RotatedQuantizer
from kvq.quant.scalar import SCALE_DTYPES, ScalarQuantizer
from kvq.rotations import SRFT, SRHT, Identity

ROTATIONS = {"identity": Identity, "srht": SRHT, "srft": SRFT}
PTX_VERSION = "8.7"  # what Triton's bundled ptxas reads; NVRTC 12.9 writes a newer one for the same code
OPCODE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def nvidia_tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def nvrtc_ptx(source: str) -> str:
    import nvidia.cuda_nvrtc

    library = ctypes.CDLL(str(Path(nvidia.cuda_nvrtc.__path__[0]) / "lib" / "libnvrtc.so.12"))
    program = ctypes.c_void_p()
    library.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"kvq.cu", 0, None, None)
    options = [b"--gpu-architecture=compute_90", b"-default-device"]
    status = library.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    if status:
        library.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        library.nvrtcGetProgramLog(program, log)
        raise SystemExit(log.value.decode())
    library.nvrtcGetPTXSize(program, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    library.nvrtcGetPTX(program, ptx)
    return re.sub(r"\.version \d+\.\d+", f".version {PTX_VERSION}", ptx.value.decode())


def assemble(ptx: str, out: Path) -> str:
    """ptxas -v report; leaves kvq.cubin and kvq.sass in out."""
    (out / "kvq.ptx").write_text(ptx)
    report = subprocess.run([nvidia_tool("ptxas"), "-arch=sm_90", "-v", str(out / "kvq.ptx"), "-o",
                             str(out / "kvq.cubin")], capture_output=True, text=True, check=True).stderr
    disassemble(out)
    return report


def disassemble(out: Path) -> None:
    sass = subprocess.run([nvidia_tool("nvdisasm"), "-c", str(out / "kvq.cubin")], capture_output=True, text=True,
                          check=True).stdout
    (out / "kvq.sass").write_text(sass)


def functions(sass: str) -> dict[str, str]:
    parts = re.split(r"^\s*\.text\.(\w+):\s*$", sass, flags=re.M)
    return {name: body.split(".section")[0] for name, body in zip(parts[1::2], parts[2::2], strict=True)}


def summarize(name: str, body: str) -> None:
    instructions = [(int(address, 16), opcode) for address, opcode in OPCODE.findall(body)]
    print(f"{name}: {len(instructions)} instructions; {histogram(op for _, op in instructions)}")
    labels = {}
    for label, address in re.findall(r"^\s*\.(L_x_\d+):\s*\n\s*/\*([0-9a-f]{4,})\*/", body, flags=re.M):
        labels[label] = int(address, 16)
    for line in body.splitlines():
        branch = re.search(r"/\*([0-9a-f]{4,})\*/.*\bBRA\b.*?\.(L_x_\d+)", line)
        if branch and labels.get(branch.group(2), 1 << 62) < int(branch.group(1), 16):
            start, end = labels[branch.group(2)], int(branch.group(1), 16)
            loop = [op for address, op in instructions if start <= address <= end]
            print(f"  loop {start:#x}-{end:#x}: {len(loop)} instructions; {histogram(loop)}")


def histogram(opcodes) -> str:
    return ", ".join(f"{op} {count}" for op, count in collections.Counter(opcodes).most_common(16))


def quantize(args, out: Path) -> None:
    granularity = "per_group" if args.group else "per_token"
    inner = ScalarQuantizer(args.bits, granularity, args.group or args.d, scale_dtype=args.scales)
    plan = plan_for(RotatedQuantizer(ROTATIONS[args.rotation](args.d, 0), inner))
    if plan is None:
        raise SystemExit(f"no kernel for d={args.d}, bits={args.bits}, group={args.group}")
    print(assemble(nvrtc_ptx(translation_unit("cuda", plan.defines(), torch.float16, torch.float16)), out))


def attention(args, out: Path) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvq.kernels import decode_attention

    kernel = decode_attention._partial_kernel
    constants = dict(GQA=4, GQA_P=4, HALF=64, BITS=4, K_GROUPS=4, V_GROUPS=4, BLOCK=args.block, DEVICE_LENGTHS=False,
                     PDL=True)
    pointers = dict(q_ptr="*fp16", qmap_ptr="*fp32", kc_ptr="*u8", ks_ptr="*fp32", vc_ptr="*u8", vs_ptr="*fp32",
                    kw_ptr="*fp16", vw_ptr="*fp16", o_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", lengths_ptr="*i64")
    signature = {name: "constexpr" if name in constants else pointers.get(name, "fp32" if name == "scale" else "i32")
                 for name in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names) if name in pointers}
    build = triton.compile(ASTSource(kernel, signature, constexprs=constants, attrs=aligned),
                           target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=args.warps, num_stages=args.stages, launch_pdl=True))
    (out / "kvq.cubin").write_bytes(build.asm["cubin"])
    (out / "kvq.ptx").write_text(build.asm["ptx"])
    disassemble(out)
    usage = subprocess.run([nvidia_tool("cuobjdump"), "-res-usage", str(out / "kvq.cubin")], capture_output=True,
                           text=True, check=True).stdout
    print(" ".join(re.findall(r"REG:\d+|STACK:\d+", usage)), f"shared {build.metadata.shared} bytes")


def cuda_attention(args, out: Path) -> None:
    print(assemble(nvrtc_ptx(cuda_partial_source(torch.float16, SCALE_DTYPES[args.scales])), out))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, help="keep the PTX, cubin and SASS here")
    kinds = parser.add_subparsers(dest="kind", required=True)
    quantize_parser = kinds.add_parser("quantize")
    quantize_parser.add_argument("--rotation", choices=sorted(ROTATIONS), default="srft")
    quantize_parser.add_argument("--d", type=int, default=128)
    quantize_parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    quantize_parser.add_argument("--group", type=int, help="scale group (default: per-token)")
    quantize_parser.add_argument("--scales", choices=("float32", "float16"), default="float32")
    attention_parser = kinds.add_parser("attention")
    attention_parser.add_argument("--block", type=int, default=64)
    attention_parser.add_argument("--warps", type=int, default=2)
    attention_parser.add_argument("--stages", type=int, default=4)
    cuda_attention_parser = kinds.add_parser("cuda-attention")
    cuda_attention_parser.add_argument("--scales", choices=("float32", "float16"), default="float32")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        out = args.out or Path(scratch)
        out.mkdir(parents=True, exist_ok=True)
        {"quantize": quantize, "attention": attention, "cuda-attention": cuda_attention}[args.kind](args, out)
        for name, body in functions((out / "kvq.sass").read_text()).items():
            summarize(name, body)


if __name__ == "__main__":
    main()
