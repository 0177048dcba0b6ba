"""Kernel sources, shipped as package data (kvq/kernels/csrc), and the translation units made from them.

The quantize body (csrc/quant_body.h) is the only place that algorithm lives; the CUDA, Metal and host
(test) builds differ only in their prelude and entry files.
"""

from importlib.resources import files

import torch

DTYPE_DEFINES = {torch.float32: "FLOAT32", torch.float16: "FLOAT16", torch.bfloat16: "BFLOAT16"}
PROGRAMMATIC_CUDA = "programmatic_cuda.h"  # griddepcontrol, for every CUDA translation unit that launches dependents
# each backend's translation unit: its prelude, the shared body, its entry
BACKEND_FILES = {"cuda": ("prelude_cuda.h", PROGRAMMATIC_CUDA, "quant_body.h", "entry_cuda.cu"),
                 "metal": ("prelude_metal.h", "quant_body.h", "entry_metal.metal"),
                 "host": ("prelude_host.h", "quant_body.h", "entry_host.cpp")}


def kernel_text(name: str) -> str:
    """The text of csrc/`name`, wherever the package is installed."""
    return files("kvq.kernels").joinpath("csrc", name).read_text()


def source_names() -> list[str]:
    return sorted(entry.name for entry in files("kvq.kernels").joinpath("csrc").iterdir() if entry.is_file())


def translation_unit(backend: str, defines: dict[str, int], in_dtype: torch.dtype, out_dtype: torch.dtype) -> str:
    lines = [f"#define {name} {value}" for name, value in defines.items()]
    lines += [f"#define KVQ_IN_{DTYPE_DEFINES[in_dtype]}", f"#define KVQ_OUT_{DTYPE_DEFINES[out_dtype]}"]
    return "\n".join(["\n".join(lines)] + [kernel_text(name) for name in BACKEND_FILES[backend]])
