"""csrc/decode_attention.cu compiles, with NVRTC, in every build kvq.kernels.cuda_decode makes, and the shared
quantize body's CUDA build in each kind of layout kvq.kernels.plan serves (no GPU needed: the GPU tests run the
builds; this catches a build that does not compile where CI has no GPU)."""

import ctypes
from pathlib import Path

import pytest
import torch

from kvq.kernels import cuda_decode
from kvq.kernels.plan import kernel_defines, unsupported_reason
from kvq.kernels.source import translation_unit
from kvq.quant.layout import PackedLayout


def _nvrtc():
    """NVIDIA's NVRTC from its pip wheel (the dev extra on Linux x86-64), or None."""
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        for library in sorted(Path(root).glob("cu*/lib/libnvrtc.so.*")):
            return ctypes.CDLL(str(library))
    return None


NVRTC = _nvrtc()
requires_nvrtc = pytest.mark.skipif(NVRTC is None, reason="NVRTC is not installed (the dev extra, Linux x86-64)")


def compile_log(source: str, arch: str) -> tuple[int, str]:
    """NVRTC's status and log for `source` compiled to a cubin for `arch`."""
    program = ctypes.c_void_p()
    assert NVRTC.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"decode_attention.cu", 0, None, None) == 0
    options = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]
    status = NVRTC.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    NVRTC.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    NVRTC.nvrtcGetProgramLog(program, log)
    NVRTC.nvrtcDestroyProgram(ctypes.byref(program))
    return status, log.value.decode(errors="replace")


# (query dtype, scale dtype, key bits, offsets, key channels, codebook, one scale per token, value bits): each kind
# of build partial_fits admits; codes below 4 bits with offsets or as codebook indices only
BUILDS = [(torch.float16, scales, bits, offsets, 0, False, False) for scales in (torch.float32, torch.float16)
          for bits in cuda_decode.KEY_BITS for offsets in (False, True) if offsets or bits >= cuda_decode.NIBBLE] + [
    (torch.float16, torch.float16, 3, True, 0, False, False, 3),
    (torch.bfloat16, torch.float32, 8, True, 0, False, False, 2),
    (torch.float16, torch.float16, 2, True, 32, False, False, 2),  # KIVI-2
    (torch.float32, torch.float16, 3, True, 16, False, False, 4),
    (torch.float16, torch.float16, 3, False, 0, True, True, 3),  # TurboQuant_mse-3
    (torch.bfloat16, torch.float16, 2, False, 0, True, False, 2),
    (torch.float16, torch.float16, 4, False, 0, True, True, 3),
    (torch.bfloat16, torch.float32, 4, False, 0, False, False),
    (torch.float32, torch.float16, 8, True, 0, False, False),
    (torch.float16, torch.float16, 4, True, 32, False, False),
    (torch.bfloat16, torch.float16, 4, True, 16, False, False),
    (torch.float16, torch.float16, 4, False, 0, True, True), (torch.bfloat16, torch.float16, 4, False, 0, True, True),
    (torch.float16, torch.float16, 4, False, 0, True, False)]


@requires_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])  # the oldest it builds on, and the one with PDL
@pytest.mark.parametrize("build", BUILDS, ids=lambda b: "-".join(str(part).replace("torch.", "") for part in b))
def test_every_decode_attention_build_compiles(build, arch):
    status, log = compile_log(cuda_decode.source(*build), arch)
    assert status == 0, log


@requires_nvrtc
def test_codes_below_4_bits_refuse_to_build_as_twos_complement():
    """They are widened into nibbles as unsigned codes: a symmetric build stops at its #error rather than misread
    their signs."""
    status, log = compile_log(cuda_decode.source(torch.float16, torch.float32, 4, False, value_bits=3), "sm_90")
    assert status != 0 and "narrower than 4 bits are read unsigned" in log


@requires_nvrtc
def test_per_channel_keys_refuse_to_build_without_fp16_stats():
    """KIVI's keys are read as fp16 words: a build with float32 stats stops at its #error rather than misread them."""
    status, log = compile_log(cuda_decode.source(torch.float16, torch.float32, 4, True, 32), "sm_90")
    assert status != 0 and "per-channel keys are KIVI's" in log


# the shared body's layouts: codes of 2, 3, 4 and 8 bits, symmetric or with offsets, per group or per token, and
# TurboQuant_mse's codebook codes of 2-4 bits (3-bit rows are whole words that do not divide a warp: the unstaged copy)
QUANTIZE_LAYOUTS = [PackedLayout(128, 4, 32, torch.float32, rotation="srft"),
                    PackedLayout(64, 8, 64, torch.float16, symmetric=False, rotation="srht"),
                    PackedLayout(128, 2, 32, torch.float16, symmetric=False),
                    PackedLayout(128, 3, 128, torch.float32, rotation="srft"),
                    *(PackedLayout(d, bits, d, torch.float16, rotation=rotation, codebook=True)
                      for d, bits, rotation in ((128, 4, "srft"), (128, 3, "srft"), (64, 2, "identity"),
                                                (256, 3, "srht")))]


@requires_nvrtc
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", QUANTIZE_LAYOUTS, ids=lambda layout: (
    f"{layout.rotation}-d{layout.head_dim}-{'codebook' if layout.codebook else 'int'}{layout.bits}"))
def test_every_kind_of_quantize_build_compiles(layout, dtype):
    assert unsupported_reason(layout) is None
    status, log = compile_log(translation_unit("cuda", dict(kernel_defines(layout)), dtype, dtype), "sm_90")
    assert status == 0, log
