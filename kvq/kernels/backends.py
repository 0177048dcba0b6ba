"""Kernel builds per device type: CUDA through NVRTC, Metal through torch.mps.compile_shader.

Both compile the same translation unit (kvq.kernels.source) on first use and keep it for the process.
A backend maps a PackedLayout, its KernelConstants and (n, d) rows to (codes, stats) and back.
"""

import ctypes
from functools import cached_property, lru_cache

import torch

from kvq.kernels.plan import THREADS_PER_GROUP, KernelConstants, kernel_defines
from kvq.kernels.source import translation_unit
from kvq.quant.layout import PackedLayout


class KernelBackend:
    name = ""

    def quantize(self, layout: PackedLayout, constants: KernelConstants,
                 rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = _chunk_aligned(rows)
        n = rows.shape[0]
        codes = torch.empty(n, layout.code_bytes, dtype=torch.uint8, device=rows.device)
        scales = torch.empty(n, layout.stats, dtype=layout.scale_dtype, device=rows.device)
        if n:
            self._launch(layout, "kvq_quantize", (rows.dtype, torch.float32), n,
                         [rows, *constants.arguments(rows.dtype, reciprocal=False), codes, scales])
        return codes, scales

    def dequantize(self, layout: PackedLayout, constants: KernelConstants, codes: torch.Tensor,
                   scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        n = codes.shape[0]
        rows = torch.empty(n, layout.head_dim, dtype=dtype, device=codes.device)
        if n:
            self._launch(layout, "kvq_dequantize", (torch.float32, dtype), n,
                         [codes, scales, *constants.arguments(dtype, reciprocal=True), rows])
        return rows

    def _launch(self, layout: PackedLayout, name: str, dtypes: tuple, n: int, args: list) -> None:
        """dtypes: (input, output) element types of the build."""
        raise NotImplementedError


def _chunk_aligned(rows: torch.Tensor) -> torch.Tensor:
    """rows, or a copy of them where they do not start on 16 bytes: the kernels read rows as 16-byte chunks."""
    return rows.clone() if rows.data_ptr() % 16 else rows


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, then a 64-byte value union 8-byte aligned."""

    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attributes", ctypes.POINTER(_LaunchAttribute)),
                ("attribute_count", ctypes.c_uint)]


PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
MAX_THREADS_PER_BLOCK = 0  # CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK


class CudaLaunch:
    """cuLaunchKernel for a function torch.cuda._compile_kernel built. torch's own launcher reopens the
    driver library, makes a ctypes array class and a Stream object at every call, host time paid twice
    at every window flush of every layer of the fused cache.
    Tensors pass as pointers, floats as float, ints as 32-bit unsigned (the kernels' uint parameters), a
    ctypes.Structure by value.
    `threads`: the block size the kernel declares in its __launch_bounds__, which every launch uses."""

    def __init__(self, kernel, device_index: int):
        self.function = kernel.func
        self.device_index = device_index
        self.driver = torch.cuda._utils._get_gpu_runtime_library()
        self.array_types: dict[int, type] = {}
        threads = ctypes.c_int()
        self._check(self.driver.cuFuncGetAttribute(ctypes.byref(threads), MAX_THREADS_PER_BLOCK, self.function))
        self.threads = threads.value

    def __call__(self, blocks: int | tuple[int, int], args: list, programmatic: bool = False) -> None:
        """programmatic: launched programmatically dependent on the stream's previous kernel (compute
        capability 9.0 on), which the kernel must then await itself (griddepcontrol.wait)."""
        values = [a if isinstance(a, ctypes.Structure)
                  else ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor)
                  else ctypes.c_float(a) if isinstance(a, float) else ctypes.c_uint(a) for a in args]
        array_type = self.array_types.get(len(values))
        if array_type is None:
            array_type = self.array_types[len(values)] = ctypes.c_void_p * len(values)
        pointers = array_type(*(ctypes.addressof(value) for value in values))
        stream = ctypes.c_void_p(torch._C._cuda_getCurrentRawStream(self.device_index))
        grid_x, grid_y = blocks if isinstance(blocks, tuple) else (blocks, 1)
        if not programmatic:
            self._check(self.driver.cuLaunchKernel(self.function, grid_x, grid_y, 1, self.threads, 1, 1, 0, stream,
                                                   pointers, None))
            return
        attribute = _LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        config = _LaunchConfig((ctypes.c_uint * 3)(grid_x, grid_y, 1), (ctypes.c_uint * 3)(self.threads, 1, 1), 0,
                               stream, ctypes.pointer(attribute), 1)
        self._check(self.driver.cuLaunchKernelEx(ctypes.byref(config), self.function, pointers, None))

    @cached_property
    def resident_blocks(self) -> int:
        """Blocks one SM holds at once (its registers and shared memory)."""
        blocks = ctypes.c_int()
        self._check(self.driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(blocks), self.function,
                                                                            self.threads, ctypes.c_size_t(0)))
        return blocks.value

    @classmethod
    def compile(cls, source: str, name: str, device: torch.device) -> "CudaLaunch":
        """Kernel `name` of CUDA `source`, built by NVRTC and loaded in `device`'s context."""
        with torch.cuda.device(device):
            return cls(torch.cuda._compile_kernel(source, name), torch.cuda.current_device())

    @staticmethod
    def _check(status: int) -> None:
        if status:
            torch.cuda._utils._check_cuda(status)


@lru_cache(maxsize=64)
def _cuda_kernel(defines: tuple, in_dtype: torch.dtype, out_dtype: torch.dtype, name: str,
                 device: torch.device) -> CudaLaunch:
    return CudaLaunch.compile(translation_unit("cuda", dict(defines), in_dtype, out_dtype), name, device)


# How far ahead, in the rows the SMs hold at once, each quantize warp prefetches rows into L2
# (csrc/entry_cuda.cu's kvq_prefetch_rows): far enough that the rows land before the warp reaches them,
# near enough that they are still in L2.
PREFETCH_WAVES = 0.6


@lru_cache(maxsize=64)
def prefetch_ahead(kernel: CudaLaunch, device: torch.device) -> int:
    """kvq_quantize's `prefetch_ahead`, in rows: PREFETCH_WAVES of what `device`'s SMs hold at once."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return int(PREFETCH_WAVES * sms * kernel.resident_blocks * kernel.threads)


WRITE_ROLES = 2  # csrc/entry_cuda.cu's KVQ_WRITE_ROLES: a static cache's K and V


class WriteRole(ctypes.Structure):
    """csrc/entry_cuda.cu's kvq_write_role, field for field."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "rows", "sign_words", "lam", "midpoints", "codes", "scales", "ring")] + [("has_lam", ctypes.c_uint)]


class WriteArguments(ctypes.Structure):
    """csrc/entry_cuda.cu's kvq_write_args, field for field."""

    _fields_ = [("roles", WriteRole * WRITE_ROLES), ("length", ctypes.c_void_p)] + [
        (name, ctypes.c_uint) for name in ("n", "tokens", "capacity", "window")]


class CudaBackend(KernelBackend):
    name = "cuda"

    def _launch(self, layout: PackedLayout, name: str, dtypes: tuple, n: int, args: list) -> None:
        kernel = _cuda_kernel(kernel_defines(layout), *dtypes, name, args[0].device)
        tail = [n, prefetch_ahead(kernel, args[0].device)] if name == "kvq_quantize" else [n]
        kernel(-(-n // kernel.threads), [*args, *tail])

    def write_rows(self, layout: PackedLayout, constants: list[KernelConstants], rows: list[torch.Tensor],
                   codes: list[torch.Tensor], scales: list[torch.Tensor], rings: list[torch.Tensor],
                   length: torch.Tensor) -> None:
        """Each role's rows (heads, T, d) quantized with its constants into positions length +
        0..T-1 of its heads' rows of codes (heads, capacity, code_bytes) and stats (heads, capacity, stats), the last
        `window` of them copied exact into its ring (heads, window, d) at those positions modulo `window`: every role
        in one launch of csrc/entry_cuda.cu's kvq_write_rows."""
        rows = [_chunk_aligned(role_rows) for role_rows in rows]  # held until the launch is queued
        heads, tokens = rows[0].shape[:2]
        n = heads * tokens
        kernel = _cuda_kernel(kernel_defines(layout), rows[0].dtype, torch.float32, "kvq_write_rows", rows[0].device)
        roles = []
        for role_constants, role_rows, role_codes, role_scales, ring in zip(constants, rows, codes, scales, rings,
                                                                             strict=True):
            words, lam, has_lam, midpoints = role_constants.arguments(role_rows.dtype, reciprocal=False)
            roles.append(WriteRole(*(t.data_ptr() for t in (role_rows, words, lam, midpoints, role_codes, role_scales,
                                                             ring)), has_lam))
        padded = roles + roles[:1] * (WRITE_ROLES - len(roles))  # slots past the grid's roles go unread
        kernel((-(-n // kernel.threads), len(roles)),
               [WriteArguments((WriteRole * WRITE_ROLES)(*padded), length.data_ptr(), n, tokens, codes[0].shape[1],
                               rings[0].shape[1])])


@lru_cache(maxsize=64)
def _metal_library(defines: tuple, in_dtype: torch.dtype, out_dtype: torch.dtype):
    return torch.mps.compile_shader(translation_unit("metal", dict(defines), in_dtype, out_dtype))


class MetalBackend(KernelBackend):
    name = "metal"

    def _launch(self, layout: PackedLayout, name: str, dtypes: tuple, n: int, args: list) -> None:
        library = _metal_library(kernel_defines(layout), *dtypes)
        device = args[0].device
        as_buffers = [torch.tensor([a], dtype=torch.int32, device=device) if isinstance(a, int) else a
                      for a in [*args, n]]
        getattr(library, name)(*as_buffers, threads=n, group_size=THREADS_PER_GROUP)


BACKENDS = {"cuda": CudaBackend(), "mps": MetalBackend()}
