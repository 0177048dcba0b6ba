"""Kernel and decode speed, measured as ratios within one run (issue: kernels and `kvq bench`).

kernels: the fused quantize kernel (ns/vector, GB/s, fraction of the device's HBM bandwidth) against
the torch reference, and fused int4 decode attention (us/step) against SDPA on fp16 K/V and against
dequantize-then-SDPA, at Llama-3-8B-like shapes. decode: ms/token of every decode path a user would pick
(HF generate with fp16 dynamic and compiled static caches, kvq's caches, transformers' quantized caches, and a
gpt-fast-style compiled step loop over the static caches) on a random-init model of a real architecture config.
"""

import functools
import gc
import itertools
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvq import kernels, ops
from kvq.errors import KvqError
from kvq.gqa_attention import GQA_SDPA_ATTENTION, gqa_sdpa
from kvq.kernels.decode_attention import DecodeStep, PackedKV, decode_attention, packed_read_bytes
from kvq.quant.packing import pack
from kvq.quant.rotated import RotatedQuantizer
from kvq.quant.scalar import SCALE_DTYPES, ScalarQuantizer
from kvq.rotations import SRFT, SRHT, Identity

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


def quantize_bytes(vectors: int, d: int, groups: int, scale_bytes: int = 4) -> int:
    """Bytes an int4 quantize call moves: fp16 rows in, packed codes and scales out."""
    return vectors * (d * 2 + d // 2 + scale_bytes * groups)


def bench_quantize(device: str, vectors: int = 262144, d: int = 128, group: int = 32) -> list[dict]:
    x = torch.randn(vectors, d, device=device, dtype=torch.float16)
    peak = peak_bandwidth(device)
    rows = []
    # The identity and SRHT rows price the rotation: the same staging, abs-max and packing with no
    # transform and with a cheaper one.
    calibrated = torch.rand(d) + 0.5
    for label, rotation, granularity, lam, scale_dtype in (
            ("srft int4 per-token", SRFT, "per_token", None, "float32"),
            ("srft int4 g32 + lambda", SRFT, "per_group", calibrated, "float32"),
            ("srft int4 g32 + lambda, fp16 scales", SRFT, "per_group", calibrated, "float16"),
            ("srht int4 per-token", SRHT, "per_token", None, "float32"),
            ("identity int4 per-token", Identity, "per_token", None, "float32")):
        quantizer = RotatedQuantizer(rotation(d, 0), ScalarQuantizer(4, granularity, group, scale_dtype=scale_dtype),
                                     lam)
        groups = 1 if granularity == "per_token" else d // group
        moved = quantize_bytes(vectors, d, groups, SCALE_DTYPES[scale_dtype].itemsize)
        fused = time_call(lambda q=quantizer: ops.encode(q, x), device, graph=True)
        eager = time_call(lambda q=quantizer: ops.encode(q, x), device)
        reference = time_call(lambda q=quantizer: q.encode(x), device, repeats=5)
        packed = ops.encode(quantizer, x)
        inverse = time_call(lambda q=quantizer, p=packed: ops.decode(q, p), device, graph=True)
        rows.append({
            "kernel": label, "vectors": vectors, "d": d, "bytes_moved": moved,
            "fused_ns_per_vector": fused / vectors * 1e9, "fused_GBps": moved / fused / 1e9,
            "fraction_of_peak_bandwidth": moved / fused / peak if peak else None,
            "eager_call_us": eager * 1e6, "reference_call_us": reference * 1e6,
            "eager_speedup_vs_reference": reference / eager,
            "inverse_ns_per_vector": inverse / vectors * 1e9, "inverse_GBps": moved / inverse / 1e9,
        })
    return rows


def random_packed(batch: int, heads: int, tokens: int, d: int, bits: int, group: int, device: str,
                  generator: torch.Generator | None = None, scale_dtype: torch.dtype = torch.float32) -> PackedKV:
    """Random codes over +-qmax with scales that give K/V of unit size whatever the width."""
    high = 1 << (bits - 1)
    codes = torch.randint(1 - high, high, (batch, heads, tokens, d), generator=generator)
    scales = (torch.rand(batch, heads, tokens, d // group, generator=generator) * 0.3 + 0.05) * 7 / (high - 1)
    return PackedKV(pack(codes, bits).to(device), scales.to(device, scale_dtype), bits, d)


# Decode reads a different layer's cache at every attention call. At 32K tokens one layer's packed
# int4 cache (42 MB) fits in a 50 MB L2, so timing one cache over and over would measure L2;
# each timed step cycles through this many distinct caches (fp16 and packed alike) and reports the mean.
LAYERS = 4


def time_per_layer(step: Callable, layers: list[tuple], device: str) -> float:
    """Graph-replay seconds of step(*args) per layer, over one call per layer's args."""
    return time_call(lambda: [step(*args) for args in layers], device, graph=True) / len(layers)


def packed_layers(tokens: int, kv_heads: int, d: int, group: int, device: str, layers: int = LAYERS,
                  scale_dtype: torch.dtype = torch.float32):
    """(keys, values) packed int4 caches for `layers` layers."""
    return [tuple(random_packed(1, kv_heads, tokens, d, 4, group, device, scale_dtype=scale_dtype) for _ in range(2))
            for _ in range(layers)]


def attention_step(device: str, tokens: int, q_heads: int, kv_heads: int, d: int, group: int,
                   layers: int = LAYERS, scale_dtype: str = "float32") -> tuple:
    """The benched decode attention step: (SRFT int4 quantizer, `layers` packed caches of `tokens` tokens,
    fp16 query (1, q_heads, 1, d), step(keys, values) -> fused attention with an 8-token window). scale_dtype:
    the caches' and the quantizer's scales, as ScalarQuantizer names them."""
    quantizer = RotatedQuantizer(SRFT(d, 0), ScalarQuantizer(4, "per_group", group, scale_dtype=scale_dtype))
    caches = packed_layers(tokens, kv_heads, d, group, device, layers, SCALE_DTYPES[scale_dtype])
    window = torch.randn(1, kv_heads, 8, d, device=device, dtype=torch.float16)
    q16 = torch.randn(1, q_heads, 1, d, device=device, dtype=torch.float16)
    rotation = quantizer.rotation.matrix().to(device)
    query_map = rotation.T.contiguous()

    def step(keys: PackedKV, values: PackedKV) -> torch.Tensor:
        return decode_attention(q16.squeeze(-2), DecodeStep(keys, values, (window, window), query_map, rotation),
                                d ** -0.5)

    return quantizer, caches, q16, step


def _attention_row(device: str, tokens: int, q_heads: int, kv_heads: int, d: int, group: int,
                   scale_dtype: str) -> dict:
    quantizer, caches, q16, step = attention_step(device, tokens, q_heads, kv_heads, d, group,
                                                  scale_dtype=scale_dtype)
    fused = time_per_layer(step, caches, device)
    eager = time_call(lambda: step(*caches[0]), device)
    fp16 = [tuple(torch.randn(1, kv_heads, tokens, d, device=device, dtype=torch.float16) for _ in range(2))
            for _ in caches]
    sdpa = time_per_layer(lambda k, v: F.scaled_dot_product_attention(q16, k, v, enable_gqa=True), fp16, device)
    del fp16

    def dequantize_then_sdpa(keys, values):
        k, v = (ops.decode(quantizer, p.as_packed(torch.float16)) for p in (keys, values))
        return F.scaled_dot_product_attention(q16, k, v, enable_gqa=True)

    dequant = time_per_layer(dequantize_then_sdpa, caches, device)
    return {
        "context": tokens, "scales": scale_dtype, "q_heads": q_heads, "kv_heads": kv_heads, "d": d,
        "layers_cycled": len(caches),
        "fused_int4_us": fused * 1e6, "fused_eager_call_us": eager * 1e6, "sdpa_fp16_us": sdpa * 1e6,
        "dequantize_then_sdpa_us": dequant * 1e6,
        "speedup_vs_sdpa_fp16": sdpa / fused, "speedup_vs_dequantize_then_sdpa": dequant / fused,
        "fused_GBps": packed_read_bytes(1, kv_heads, tokens, d, 4, group, SCALE_DTYPES[scale_dtype].itemsize)
        / fused / 1e9,
    }


def bench_attention(device: str, contexts=(1024, 8192, 32768, 131072), q_heads: int = 32, kv_heads: int = 8,
                    d: int = 128, group: int = 32, scale_dtypes=("float32", "float16")) -> list[dict]:
    return [_attention_row(device, tokens, q_heads, kv_heads, d, group, scale_dtype)
            for scale_dtype in scale_dtypes for tokens in contexts]


def bench_kernels(device: str, vectors: int = 262144, contexts=(1024, 8192, 32768, 131072)) -> dict:
    if not device.startswith("cuda") and device != "mps":
        raise KvqError("kvq bench kernels times GPU kernels; run it with --device cuda or mps")
    return {
        "peak_bandwidth_Bps": peak_bandwidth(device), "copy_bandwidth_Bps": copy_bandwidth(device),
        "available": kernels.available(), "quantize": bench_quantize(device, vectors),
        "attention": bench_attention(device, contexts),
    }


def llama3_8b_like():
    """Llama-3-8B's architecture (random weights: speed does not depend on them)."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
                       max_position_embeddings=131072)


class CacheUnavailable(Exception):
    """A compared cache that cannot run here; its row says why instead of a time."""


@dataclass(frozen=True)
class DecodeCache:
    """One row kind of `kvq bench decode`: `setup(model, batch, max_tokens)` returns generate's keyword
    arguments for one run (a fresh cache, or the name of one generate builds), or raises CacheUnavailable."""

    name: str  # what --caches takes
    label: str
    precision: str  # "fp16" rows are what a user would otherwise run; the best of them is the yardstick
    setup: Callable[..., dict]
    loop: str = "generate"  # "generate": HF generate; "step": greedy_step_loop, a compiled step per token
    attention: str | None = None  # an attention implementation the row runs under (None: the model's own)


def _compiled_on_cuda(model) -> None:
    """Static-cache rows compile their decode step (generate's or the step loop's), which is timed on CUDA only."""
    if model.device.type != "cuda":
        raise CacheUnavailable("a static cache's decode step is compiled on CUDA only")


def _kvq_int4(model, batch: int, max_tokens: int) -> dict:
    from kvq.apply import QuantizerBank, kv_geometry
    from kvq.cache import QuantizedKVCache
    from kvq.quant import QuantSpec

    bank = QuantizerBank(QuantSpec("srft", 4, "per_group", 32), kv_geometry(model.config))
    return {"past_key_values": QuantizedKVCache(bank, model.config, fused=True)}


def _kvq_int4_static(model, batch: int, max_tokens: int) -> dict:
    from kvq.apply import QuantizerBank, kv_geometry
    from kvq.quant import QuantSpec
    from kvq.static_cache import StaticQuantizedCache

    _compiled_on_cuda(model)
    bank = QuantizerBank(QuantSpec("srft", 4, "per_group", 32), kv_geometry(model.config))
    cache = StaticQuantizedCache(bank, model.config, max_cache_len=max_tokens).allocate(model, batch)
    return {"past_key_values": cache}


def _transformers_quantized(backend: str) -> Callable[..., dict]:
    def setup(model, batch: int, max_tokens: int) -> dict:
        from transformers import QuantizedCache

        try:
            return {"past_key_values": QuantizedCache(backend=backend, config=model.config, nbits=4)}
        except Exception as exc:  # a missing or incompatible backend package: the row says which
            raise CacheUnavailable(f"transformers QuantizedCache({backend}): {_one_line(exc)}") from exc

    return setup


def _fp16_dynamic(model, batch: int, max_tokens: int) -> dict:
    from transformers import DynamicCache

    return {"past_key_values": DynamicCache(config=model.config)}


def _fp16_static_compiled(model, batch: int, max_tokens: int) -> dict:
    _compiled_on_cuda(model)
    return {"cache_implementation": "static"}  # generate builds it and compiles the decode step


def _fp16_static(model, batch: int, max_tokens: int) -> dict:
    from transformers import StaticCache

    _compiled_on_cuda(model)
    return {"past_key_values": StaticCache(config=model.config, max_cache_len=max_tokens)}


DECODE_CACHES = (  # the first is the paired ratios' baseline
    DecodeCache("fp16-dynamic", "fp16 DynamicCache eager", "fp16", _fp16_dynamic),
    DecodeCache("fp16-static-compiled", "fp16 StaticCache compiled", "fp16", _fp16_static_compiled),
    DecodeCache("kvq-int4", "kvq fused int4 g32 eager", "int4", _kvq_int4),
    DecodeCache("kvq-int4-static-compiled", "kvq int4 static compiled", "int4", _kvq_int4_static),
    DecodeCache("quanto-int4", "transformers QuantizedCache quanto int4", "int4", _transformers_quantized("quanto")),
    DecodeCache("hqq-int4", "transformers QuantizedCache hqq int4", "int4", _transformers_quantized("hqq")),
    DecodeCache("fp16-static-step", "fp16 StaticCache, compiled step loop", "fp16", _fp16_static, loop="step"),
    DecodeCache("kvq-int4-static-step", "kvq int4 static, compiled step loop", "int4", _kvq_int4_static, loop="step"),
    # The fair fp16 rows: SDPA reads each K/V head once (transformers' sdpa repeats it per query head under the
    # static cache's mask, see kvq.gqa_attention).
    DecodeCache("fp16-gqa-static-compiled", "fp16 StaticCache compiled, SDPA enable_gqa", "fp16",
                _fp16_static_compiled, attention=GQA_SDPA_ATTENTION),
    DecodeCache("fp16-gqa-static-step", "fp16 StaticCache, SDPA enable_gqa, compiled step loop", "fp16", _fp16_static,
                loop="step", attention=GQA_SDPA_ATTENTION),
)


def decode_caches(names: tuple[str, ...] | None = None) -> tuple[DecodeCache, ...]:
    if names is None:
        return DECODE_CACHES
    known = {cache.name: cache for cache in DECODE_CACHES}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise KvqError(f"unknown decode cache {unknown[0]!r}; known: {', '.join(known)}")
    return tuple(known[name] for name in names)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def _held_bytes(cache) -> int | None:
    """Bytes of K/V a cache holds, where its layers are kvq's or transformers' plain dynamic and static
    layers (None for transformers' quantized layers, whose packed tensors are the backends' own)."""
    from transformers.cache_utils import DynamicLayer, QuantizedLayer, StaticLayer

    from kvq.cache import QuantizedKVCache, held_bytes
    from kvq.static_cache import StaticQuantizedCache

    if isinstance(cache, (QuantizedKVCache, StaticQuantizedCache)):
        return cache.memory_bytes()
    layers = getattr(cache, "layers", None)
    plain = [isinstance(layer, (DynamicLayer, StaticLayer)) and not isinstance(layer, QuantizedLayer)
             and isinstance(getattr(layer, "keys", None), torch.Tensor) for layer in layers or ()]
    if not plain or not all(plain):
        return None
    return held_bytes(t for layer in layers for t in (layer.keys, layer.values))


def _fp16_kv_bytes(config, batch: int, tokens: int) -> int:
    from kvq.apply import kv_geometry

    geometry = kv_geometry(config)
    return 2 * geometry.n_layers * geometry.n_kv_heads * geometry.head_dim * tokens * batch * 2


class StepClock:
    """Marks every generated token on the device's timeline (a CUDA event; the host clock off CUDA), as
    generate's logits processor or through `tick` from the step loop: the gaps are single decode steps, so
    ms/token is a median over steps and not a difference of two whole decode calls. Marking adds no host
    synchronisation, so a path whose host work overlaps the GPU's (a compiled step) is timed as it runs for a
    user."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = []
        self.begin()

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self) -> None:
        self.start = self._mark()

    def tick(self) -> None:
        self.marks.append(self._mark())

    def __call__(self, input_ids, scores):
        self.tick()
        return scores

    def seconds(self) -> tuple[float, list[float]]:
        """(prompt to first token, every step after it), once the device has caught up."""
        if not self.cuda:
            return self.marks[0] - self.start, [b - a for a, b in itertools.pairwise(self.marks)]
        self.marks[-1].synchronize()
        return (self.start.elapsed_time(self.marks[0]) / 1e3,
                [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(self.marks)])


@dataclass
class _Run:
    prefill_s: float
    steps_s: list[float]
    held_bytes: int | None
    peak_bytes: int | None


def _greedy_step(model, cache, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    # positions given both ways: transformers releases differ in which of the two they read
    logits = model(input_ids=token, position_ids=position[None], cache_position=position, past_key_values=cache,
                   use_cache=True).logits
    return logits[:, -1].argmax(-1, keepdim=True)


# gpt-fast's compile settings: a CUDA graph per step ("reduce-overhead") and coordinate-descent tuning, under
# which inductor turns one-row matmuls (batch-1 decode's weight GEMVs) into reductions it tunes to the memory
# bandwidth, where cuBLAS's split-K GEMVs fall short of it.
STEP_COMPILE_OPTIONS = {"triton.cudagraphs": True, "coordinate_descent_tuning": True}


@functools.cache
def _compiled_greedy_step():
    # one graph per model, cache type and shape (no dynamic shapes: CUDA graphs need fixed ones)
    return torch.compile(_greedy_step, options=STEP_COMPILE_OPTIONS, fullgraph=True, dynamic=False)


# Graphs the step loop may hold: (compared caches) x (prompt lengths) x (batches) of one run; past dynamo's
# default limit it would fall back to eager without saying so.
STEP_GRAPHS = 64


def greedy_step_loop(model, cache, prompt: torch.Tensor, tokens: int, prefill_chunk: int | None = None,
                     on_token: Callable[[], None] | None = None, compiled: bool = True) -> torch.Tensor:
    """Greedy decoding without generate's loop, as gpt-fast runs it: the prompt prefilled eagerly (in chunks of
    `prefill_chunk` tokens if given) into `cache`, a static cache, then one compiled step per token (forward and
    argmax, replayed as a CUDA graph) whose inputs stay on the device, so the host never waits for the GPU
    and queues the next step while the current one runs. `on_token` is called as each token is queued.
    Returns the (B, tokens) generated tokens. A prompt with padding is not supported (no attention mask).
    The step's CUDA graph is recorded over the cache's buffers: decode prompt after prompt with one cache,
    `cache.reset()` between them, since each fresh cache makes the step record (and keep) another graph."""
    length = prompt.shape[1]
    chunk = prefill_chunk or length
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        positions = torch.arange(start, end, device=prompt.device)
        logits = model(input_ids=prompt[:, start:end], position_ids=positions[None], cache_position=positions,
                       past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    token = logits[:, -1].argmax(-1, keepdim=True)
    generated = [token]
    if on_token:
        on_token()
    step = _compiled_greedy_step() if compiled else _greedy_step
    position = torch.tensor([length], device=prompt.device)
    with torch._dynamo.config.patch(recompile_limit=STEP_GRAPHS, fail_on_recompile_limit_hit=True):
        for _ in range(tokens - 1):
            token = step(model, cache, token, position).clone()  # the graph's output buffer is reused
            position += 1
            generated.append(token)
            if on_token:
                on_token()
    return torch.cat(generated, dim=1)


def graphs_recorded() -> int:
    """CUDA graphs inductor has recorded in this process (a compiled step records one per new set of cache
    buffers)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_recorded_non_static_inputs"]


def decode_routing(model, cache, attention: str | None = None):
    """The context a decode with `cache` runs in: kvq's fused attention for kvq's caches, else the attention
    implementation named (only kvq.gqa_attention's is known), else none."""
    from kvq.cache import QuantizedKVCache, fused_decoding
    from kvq.static_cache import StaticQuantizedCache

    if isinstance(cache, (QuantizedKVCache, StaticQuantizedCache)):
        return fused_decoding(model, cache)
    if attention == GQA_SDPA_ATTENTION:
        return gqa_sdpa(model)
    if attention is not None:
        raise KvqError(f"unknown decode attention {attention!r}; known: {GQA_SDPA_ATTENTION}")
    return nullcontext()


def decode_run(model, loop: str, kwargs: dict, prompt: torch.Tensor, tokens: int,
               prefill_chunk: int | None = None, attention: str | None = None) -> _Run:
    """One greedy decode of `tokens` tokens through `loop` ("generate" or "step", see DecodeCache) with
    generate's keyword arguments `kwargs` (the cache), the prompt prefilled in chunks of `prefill_chunk`
    tokens if given, under the attention implementation `attention` if named (see decode_routing)."""
    from transformers import LogitsProcessorList

    cache = kwargs.get("past_key_values")
    cuda = prompt.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(prompt.device)
    with torch.no_grad(), decode_routing(model, cache, attention):
        _synchronize(prompt.device)
        clock = StepClock(prompt.device)
        if loop == "step":
            greedy_step_loop(model, cache, prompt, tokens, prefill_chunk, on_token=clock.tick)
        else:
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens,
                           min_new_tokens=tokens, do_sample=False, logits_processor=LogitsProcessorList([clock]),
                           prefill_chunk_size=prefill_chunk, **kwargs)
    prefill_s, steps_s = clock.seconds()
    held = _held_bytes(cache if cache is not None else getattr(model, "_cache", None))
    peak = torch.cuda.max_memory_allocated(prompt.device) if cuda else None
    return _Run(prefill_s, steps_s, held, peak)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _decode_rows(model, caches: tuple[DecodeCache, ...], prompt: torch.Tensor, new_tokens: int,
                 repeats: int, prefill_chunk: int | None) -> list[dict]:
    """Per cache: median step time over `repeats` generates of new_tokens tokens. Each cache first runs
    one untimed generate of the same length (allocator and kernel warm-up, and a compiled row's
    compilation); then the caches take turns run by run, with Python's garbage collector held off, so
    drift in the host's speed (runs of one cache vary by 2x on a shared host) falls on all of them alike.
    A cache that cannot run (unavailable here, or out of memory) gives a row that says why."""
    batch, length = prompt.shape
    max_tokens = length + new_tokens
    where = {"prompt": length, "batch": batch}
    skipped, ready = [], []
    for cache in caches:
        try:
            decode_run(model, cache.loop, cache.setup(model, batch, max_tokens), prompt, new_tokens, prefill_chunk,
                       cache.attention)
            ready.append(cache)
        except CacheUnavailable as exc:
            skipped.append({**where, "cache": cache.label, "skipped": str(exc)})
        except torch.OutOfMemoryError:
            skipped.append({**where, "cache": cache.label, "skipped": f"out of memory at batch {batch}"})
        _release(prompt.device)
    runs: dict[str, list[_Run]] = {cache.label: [] for cache in ready}
    collecting = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            for cache in ready:
                runs[cache.label].append(decode_run(model, cache.loop, cache.setup(model, batch, max_tokens),
                                                     prompt, new_tokens, prefill_chunk, cache.attention))
    finally:
        if collecting:
            gc.enable()
    run_medians = {label: [statistics.median(run.steps_s) * 1e3 for run in timed] for label, timed in runs.items()}
    baseline = run_medians[ready[0].label] if ready else []
    rows = []
    for cache in ready:
        timed = runs[cache.label]
        steps = [step for run in timed for step in run.steps_s]
        held = timed[-1].held_bytes
        rows.append({
            **where, "cache": cache.label, "precision": cache.precision,
            "ms_per_token": statistics.median(steps) * 1e3, "ms_per_token_mean": statistics.mean(steps) * 1e3,
            "ms_per_token_runs": run_medians[cache.label],
            # runs of one repeat are adjacent in time, so their ratio cancels most of the host's drift
            "paired_ratio_to_first": statistics.median(a / b for a, b in zip(run_medians[cache.label], baseline,
                                                                              strict=True)),
            "prefill_s": statistics.median(run.prefill_s for run in timed),
            "cache_bytes": held,
            # K/V a step reads: what the cache holds, or for an fp16 cache of unknown layout the prompt's fp16 K/V
            "kv_read_bytes": held if held is not None else (
                _fp16_kv_bytes(model.config, batch, length) if cache.precision == "fp16" else None),
            "peak_bytes": max((run.peak_bytes for run in timed if run.peak_bytes is not None), default=None),
        })
    return rows + skipped


def _weight_read_bytes(model) -> int:
    """Weights a decode step reads: every parameter but the input embedding, of which it reads a row."""
    embedding = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding)


def _with_floors(rows: list[dict], weight_bytes: int, bandwidth: float | None) -> list[dict]:
    """Each row's bandwidth floor (weights + K/V read per step at the measured copy rate), its time's ratio
    to that floor, its speed against the fastest fp16 row of the same prompt and batch, and how much of the
    bytes-ideal speedup (that fp16 row's floor over this row's: what the bytes alone allow) the speed reaches."""

    def floor_ms(row: dict) -> float | None:
        return (weight_bytes + row["kv_read_bytes"]) / bandwidth * 1e3 if bandwidth and row["kv_read_bytes"] else None

    best_fp16 = {}
    for row in rows:
        if row.get("precision") == "fp16":
            key = (row["prompt"], row["batch"])
            if key not in best_fp16 or row["ms_per_token"] < best_fp16[key]["ms_per_token"]:
                best_fp16[key] = row
    for row in rows:
        if "skipped" in row:
            continue
        floor = floor_ms(row)
        row["floor_ms"] = floor
        row["ratio_to_floor"] = row["ms_per_token"] / floor if floor else None
        best = best_fp16.get((row["prompt"], row["batch"]))
        row["speedup_vs_best_fp16"] = best["ms_per_token"] / row["ms_per_token"] if best else None
        best_floor = floor_ms(best) if best else None
        row["bytes_ideal_speedup"] = best_floor / floor if best_floor and floor else None
        row["fraction_of_bytes_ideal"] = (row["speedup_vs_best_fp16"] / row["bytes_ideal_speedup"]
                                          if row["bytes_ideal_speedup"] else None)
    return rows


def decode_model(device: str, config) -> torch.nn.Module:
    """A random-weight fp16 Llama of `config` on `device` (speed does not depend on the weights)."""
    from transformers import LlamaForCausalLM

    with torch.device(device):
        return LlamaForCausalLM._from_config(config, dtype=torch.float16).eval()


def bench_decode(device: str, prompts=(8192, 32768), new_tokens: int = 32, config=None, repeats: int = 9,
                 batches=(1,), caches: tuple[DecodeCache, ...] = DECODE_CACHES,
                 prefill_chunk: int | None = None) -> dict:
    """ms/token per cache and decode loop at each prompt length and batch (see _decode_rows), on a random-weight
    fp16 Llama of `config` (Llama-3-8B's by default); every cache prefills in chunks of `prefill_chunk` tokens
    (generate's prefill_chunk_size) if given."""
    model = decode_model(device, config or llama3_8b_like())
    config = model.config
    bandwidth = copy_bandwidth(device) if device.startswith("cuda") else None
    rows = []
    for batch in batches:
        for length in prompts:
            prompt = torch.randint(0, config.vocab_size, (batch, length), device=device)
            rows += _decode_rows(model, caches, prompt, new_tokens, repeats, prefill_chunk)
            _release(prompt.device)
    return {"model": "Llama-3-8B architecture, random fp16 weights", "new_tokens": new_tokens, "repeats": repeats,
            "prefill_chunk": prefill_chunk,
            "copy_bandwidth_Bps": bandwidth, "rows": _with_floors(rows, _weight_read_bytes(model), bandwidth)}


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def kernels_tables(result: dict) -> str:
    from kvq.ledger import markdown_table

    quantize = markdown_table(
        ["kernel", "vectors x d", "ns/vec", "GB/s", "of peak BW", "inverse ns/vec", "eager call us",
         "torch reference us"],
        [[r["kernel"], f"{r['vectors']} x {r['d']}", _fmt(r["fused_ns_per_vector"], 2), _fmt(r["fused_GBps"]),
          _fmt(100 * r["fraction_of_peak_bandwidth"] if r["fraction_of_peak_bandwidth"] else None) + "%",
          _fmt(r["inverse_ns_per_vector"], 2), _fmt(r["eager_call_us"]), _fmt(r["reference_call_us"])]
         for r in result["quantize"]])
    attention = markdown_table(
        ["context", "scales", "fused int4 us", "SDPA fp16 us", "dequant+SDPA us", "vs SDPA fp16", "vs dequant+SDPA",
         "fused GB/s", "fused eager call us"],
        [[str(r["context"]), r["scales"], _fmt(r["fused_int4_us"]),
          _fmt(r["sdpa_fp16_us"]), _fmt(r["dequantize_then_sdpa_us"]),
          _fmt(r["speedup_vs_sdpa_fp16"], 2) + "x", _fmt(r["speedup_vs_dequantize_then_sdpa"], 2) + "x",
          _fmt(r["fused_GBps"]), _fmt(r["fused_eager_call_us"])] for r in result["attention"]])
    peak, copy = result["peak_bandwidth_Bps"], result["copy_bandwidth_Bps"]
    bandwidth = (f"Datasheet HBM bandwidth {_fmt(peak / 1e12 if peak else None, 2)} TB/s; a device-to-device copy "
                 f"measured {copy / 1e12:.2f} TB/s (read + write).")
    timing = ("Kernel columns are CUDA-graph replays (GPU time, no Python launch cost); an attention step is "
              f"the mean over {LAYERS} distinct layers' caches replayed back to back, as decode reads them, so "
              "L2 cannot serve a cache from the previous call. 'eager call' columns time the Python call as a "
              "user makes it.")
    return "\n\n".join([bandwidth, timing, "Fused quantize (fp16 input):", quantize,
                        "Decode attention, 32 query / 8 KV heads, d=128, int4 g32 (one step):", attention])


def decode_table(result: dict) -> str:
    from kvq.ledger import markdown_table

    mib = 2**20
    rows = []
    for r in result["rows"]:
        if "skipped" in r:
            rows.append([str(r["prompt"]), str(r["batch"]), r["cache"], "skipped: " + r["skipped"]] + ["-"] * 10)
            continue
        rows.append([str(r["prompt"]), str(r["batch"]), r["cache"], _fmt(r["ms_per_token"], 2),
                     _fmt(r["ms_per_token_mean"], 2), _fmt(r["paired_ratio_to_first"], 3),
                     _fmt(r["speedup_vs_best_fp16"], 2) + "x" if r["speedup_vs_best_fp16"] else "-",
                     _fmt(r.get("bytes_ideal_speedup"), 2) + "x" if r.get("bytes_ideal_speedup") else "-",
                     _fmt(r.get("fraction_of_bytes_ideal"), 2),
                     _fmt(r["floor_ms"], 2), _fmt(r["ratio_to_floor"], 2), _fmt(r["prefill_s"], 2),
                     _fmt(r["cache_bytes"] / mib if r["cache_bytes"] is not None else None),
                     _fmt(r["peak_bytes"] / mib if r["peak_bytes"] is not None else None)])
    copy = result.get("copy_bandwidth_Bps")
    floor = ("Floor: (weights read per step + the K/V the cache holds) / the measured device copy rate "
             f"({copy / 1e12:.2f} TB/s). Bytes-ideal: the fastest fp16 row's floor over the row's floor; 'of ideal': "
             "the speed vs that row as a fraction of it." if copy else "No bandwidth floor off CUDA.")
    return floor + "\n\n" + markdown_table(
        ["prompt", "batch", "cache", "ms/token (median)", "ms/token (mean)", "time vs first row, paired (median)",
         "speed vs best fp16", "bytes-ideal", "of ideal", "floor ms", "x floor", "prefill s", "cache MiB",
         "peak MiB"], rows)
