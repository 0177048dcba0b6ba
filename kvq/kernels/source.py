"""Assembles a kernel translation unit: shape defines + backend prelude + shared body + entry points.

The body (kernels/quant_body.h) is the only place the algorithm lives; the CUDA, Metal and host
(test) builds differ only in their prelude and entry files.
"""

from pathlib import Path

import torch

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
DTYPE_DEFINES = {torch.float32: "FLOAT32", torch.float16: "FLOAT16", torch.bfloat16: "BFLOAT16"}
BACKEND_FILES = {"cuda": ("prelude_cuda.h", "entry_cuda.cu"), "metal": ("prelude_metal.h", "entry_metal.metal"),
                 "host": ("prelude_host.h", "entry_host.cpp")}


def translation_unit(backend: str, defines: dict[str, int], in_dtype: torch.dtype, out_dtype: torch.dtype) -> str:
    prelude, entry = BACKEND_FILES[backend]
    lines = [f"#define {name} {value}" for name, value in defines.items()]
    lines += [f"#define KVQ_IN_{DTYPE_DEFINES[in_dtype]}", f"#define KVQ_OUT_{DTYPE_DEFINES[out_dtype]}"]
    parts = ["\n".join(lines)] + [(KERNEL_DIR / name).read_text() for name in (prelude, "quant_body.h", entry)]
    return "\n".join(parts)
