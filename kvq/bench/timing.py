"""Clocks for speed measured as ratios within one run: CUDA-graph replays, the device's copy rate (the bandwidth
floors' denominator), and a step cycled through several layers' caches."""

import statistics
import time
from collections.abc import Callable

import torch

# Datasheet HBM bandwidth (bytes/s) by device name fragment; the measured copy rate is reported beside it.
PEAK_BANDWIDTH = {"H100 80GB HBM3": 3.35e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H200": 4.8e12,
                  "A100-SXM4-80GB": 2.039e12, "A100-SXM4-40GB": 1.555e12}


# GPU clock cycles a graph-replay sample spins before its start event: longer than the host takes to
# submit the replay, so the timed span holds the graph's kernels only (see time_call).
LAUNCH_COVER_CYCLES = 200_000


def time_call(fn: Callable[[], object], device: str, repeats: int = 20, warmup: int = 3,
              graph: bool = False) -> float:
    """Median seconds per call. graph=True (CUDA) captures fn once and times graph replays: the GPU time
    of its kernels without Python launch cost, which is what a kernel comparison is about. Each replay
    queues behind a GPU spin, as Triton's do_bench queues each call behind a cache flush: on an idle GPU
    the start event fires at once and the span would also hold the host's submission of the replay."""
    for _ in range(warmup):
        fn()
    graphed = graph and device.startswith("cuda")
    if graphed:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()
        fn = captured.replay
    samples = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if graphed:
                torch.cuda._sleep(LAUNCH_COVER_CYCLES)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            if device == "mps":
                torch.mps.synchronize()
            samples.append(time.perf_counter() - began)
    return statistics.median(samples)


def peak_bandwidth(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(torch.device(device))
    return next((bw for fragment, bw in PEAK_BANDWIDTH.items() if fragment in name), None)


def copy_bandwidth(device: str, n_bytes: int = 1 << 30) -> float:
    """Bytes read plus written per second by a device-to-device copy: what the memory system gives."""
    source = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * n_bytes / time_call(lambda: target.copy_(source), device, repeats=10)


# Decode reads a different layer's cache at every attention call. At 32K tokens one layer's packed
# int4 cache (42 MB) fits in a 50 MB L2, so timing one cache over and over would measure L2;
# each timed step cycles through this many distinct caches (fp16 and packed alike) and reports the mean.
LAYERS = 4


def time_per_layer(step: Callable, layers: list[tuple], device: str) -> float:
    """Graph-replay seconds of step(*args) per layer, over one call per layer's args."""
    return time_call(lambda: [step(*args) for args in layers], device, graph=True) / len(layers)
