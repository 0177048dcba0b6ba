"""torchao's MX and NVFP4 reference conversions of the tensors in a file, written to another file.

Run as its own process (tests/test_engine_formats.py does) with torchao on PYTHONPATH: importing torchao
makes transformers import it too, and its import prints warnings, so it stays out of kvq's environment.
Usage: python tests/torchao_reference.py INPUT.pt OUTPUT.pt
"""

import sys

import torch
from torchao.prototype.mx_formats import kernels, mx_tensor, nvfp4_tensor

MX_ELEMENTS = {"e2m1": torch.float4_e2m1fn_x2, "e2m3": "fp6_e2m3", "e3m2": "fp6_e3m2",
               "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
ELEMENTS = {"e2m1": kernels.f32_to_f4_unpacked, "e2m3": kernels.f32_to_f6_e2m3_unpacked,
            "e3m2": kernels.f32_to_f6_e3m2_unpacked}


def main(source: str, target: str) -> None:
    inputs = torch.load(source)
    x, line = inputs["blocks"], inputs["line"]
    out = {f"element/{name}": convert(line) for name, convert in ELEMENTS.items()}
    for name, elem_dtype in MX_ELEMENTS.items():
        scales, data = mx_tensor.to_mx(x.contiguous(), elem_dtype, 32)
        raw = data.view(torch.uint8)
        out[f"mx/{name}/scales"] = scales.view(torch.uint8)
        out[f"mx/{name}/codes"] = kernels.unpack_uint4(raw).reshape(x.shape) if name == "e2m1" else raw.reshape(x.shape)
        out[f"mx/{name}/values"] = mx_tensor.to_dtype(data, scales, elem_dtype, 32, torch.float32).reshape(x.shape)
    layer_scale = nvfp4_tensor.per_tensor_amax_to_scale(x.abs().amax())
    scales, data = nvfp4_tensor.nvfp4_quantize(x.reshape(-1, x.shape[-1]).contiguous(), 16, layer_scale)
    out["nvfp4/layer_scale"] = layer_scale
    out["nvfp4/scales"] = scales.view(torch.uint8).reshape(*x.shape[:-1], -1)
    out["nvfp4/codes"] = kernels.unpack_uint4(data.view(torch.uint8)).reshape(x.shape)
    torch.save(out, target)


if __name__ == "__main__":
    main(*sys.argv[1:])
