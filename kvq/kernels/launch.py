"""Launch choices of the decode attention step: an explicit per-device table, and the split-K arithmetic.

Nothing here is mutable: a caller that wants other choices (benchmarks/attention_configs.py sweeps them)
passes its own LaunchConfig to kvq.kernels.decode_attention.decode_attention.
"""

from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType

import torch


@dataclass(frozen=True)
class LaunchConfig:
    """Tile and pipelining choices of the Triton partial kernel, and which partial kernel serves.

    Four stages keep three tiles in flight; more leave shared memory for too few programs. Each SM is bound
    by the loads its programs keep in flight, not by HBM, so the sequence is split into as many programs as
    the SMs hold at once (waves=None, from the compiled kernel's registers and shared memory): a program per
    SM more queues behind the others, one fewer leaves loads unissued."""

    block: int = 64
    num_warps: int = 2
    num_stages: int = 4
    waves: int | None = None  # programs per SM to aim for when splitting the sequence; None: as many as fit
    programmatic: bool = True  # programmatic dependent launch where the device has it
    # "cuda": csrc/decode_attention.cu's partial kernel where the shape and length fit; "triton": always Triton
    partial: str = "cuda"


DEFAULT_LAUNCH = LaunchConfig()
# Per compute capability major: the fastest of benchmarks/attention_configs.py's sweeps (Llama-3-8B shapes,
# int4 g32) where one was run; other devices take the default, which those sweeps chose on 9.x.
LAUNCH_TABLE = MappingProxyType({9: DEFAULT_LAUNCH})


@lru_cache(maxsize=8)
def properties(device: torch.device):
    return torch.cuda.get_device_properties(device)


def launch_for(device: torch.device) -> LaunchConfig:
    return LAUNCH_TABLE.get(properties(device).major, DEFAULT_LAUNCH)


def programmatic_launch(launch: LaunchConfig, device: torch.device) -> bool:
    """Programmatic dependent launch (each kernel's launch overlaps the one before) needs compute capability 9.0."""
    return launch.programmatic and properties(device).major >= 9


REGISTERS_PER_SM = 65536  # every NVIDIA GPU since Maxwell
REGISTER_GRANULE = 256  # registers are allocated per warp in blocks of 256
SHARED_RESERVED_PER_PROGRAM = 1024  # the driver's share of shared memory per resident block (sm_80 on)


def resident_programs(registers: int, shared_bytes: int, num_warps: int, shared_per_sm: int,
                      threads_per_sm: int) -> int:
    """Programs of a kernel (registers per thread, shared bytes per program) that one SM holds at once."""
    warp_registers = -(-registers * 32 // REGISTER_GRANULE) * REGISTER_GRANULE
    by_registers = REGISTERS_PER_SM // (warp_registers * num_warps)
    by_shared = shared_per_sm // (shared_bytes + SHARED_RESERVED_PER_PROGRAM)
    return max(1, min(by_registers, by_shared, threads_per_sm // (32 * num_warps)))


def triton_resident_programs(build, device: torch.device) -> int:
    """resident_programs of a compiled Triton kernel on `device`."""
    device_properties = properties(device)
    return resident_programs(build.n_regs, build.metadata.shared, build.metadata.num_warps,
                             device_properties.shared_memory_per_multiprocessor,
                             device_properties.max_threads_per_multi_processor)


def split_plan(n_packed: int, programs_per_split: int, resident: int, launch: LaunchConfig,
               device: torch.device) -> tuple[int, int]:
    """(splits over the packed tokens, tokens per split): as many packed programs as fill every SM `resident`
    times (launch.waves times where set), and never more: a program past what the SMs hold at once starts only
    when another ends, then streams its whole split alone at the end; so the splits round down. Each head's
    window program comes on top: it is short, and takes the first slot that frees."""
    target = (launch.waves or resident) * properties(device).multi_processor_count
    return split_counts(n_packed, programs_per_split, target, launch.block)


def split_counts(n_packed: int, programs_per_split: int, programs: int, block: int) -> tuple[int, int]:
    """(splits, tokens per split, a multiple of `block`) of n_packed tokens, each split taken by
    `programs_per_split` programs, for at most `programs` programs in all (one split at least)."""
    if n_packed == 0:
        return 0, block
    splits = max(1, min(programs // programs_per_split, -(-n_packed // block)))
    per_split = -(-n_packed // splits)
    per_split = -(-per_split // block) * block
    return -(-n_packed // per_split), per_split
