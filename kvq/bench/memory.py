"""`kvq bench memory`: per cache kind, the largest batch at a context length and the longest context at one row
that fit on the device (Llama-3-8B shapes, random fp16 weights). A setting fits when its static cache, allocated
for the whole context, and a prefill chunk and a few decode steps run into it do not run out of device memory;
the search doubles, then bisects."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from kvq.bench.decode import FP_BOUNDARY, K8_V4, cache_bytes, decode_model, llama3_8b_like, release_memory
from kvq.errors import KvqError
from kvq.generate import decode_routing, generate, static_cache
from kvq.gqa_attention import GQA_SDPA_ATTENTION
from kvq.policy import parse_policy
from kvq.quant import QuantSpec

# Every layer exact: kvq's static cache holding plain fp16 layers, its prefill reading the positions written as its
# quantized layers' does (transformers' StaticCache attends over its whole capacity, repeating K/V per query head)
EVERY_LAYER_FP = {"layers": [{"first": 1 << 20, "use": "fp"}]}
MEMORY_CACHES = {  # the caches of `kvq bench decode`'s step rows: (spec, per-site policy, exact window)
    "fp16": (None, None, 16),
    "fp16-kvq": (QuantSpec("srft", 4, "per_group", 32), EVERY_LAYER_FP, 16),
    "kvq-int4": (QuantSpec("srft", 4, "per_group", 32), None, 16),
    "kvq-int4-fp-boundary": (QuantSpec("srft", 4, "per_group", 32), FP_BOUNDARY, 16),
    "kvq-k8v4": (QuantSpec("srft", 4, "per_group", 32), K8_V4, 16),
    "kvq-kivi4": (QuantSpec("kivi", 4, group_size=32), None, 32),  # the window holds a whole key group
    "kvq-kivi2": (QuantSpec("kivi", 2, group_size=32), None, 32),
    "kvq-turbo4": (QuantSpec("turbo", 4), None, 16),
    "kvq-turbo3": (QuantSpec("turbo", 3), None, 16),
    "kvq-mxfp4": (QuantSpec("mx"), None, 16),
    "kvq-nvfp4": (QuantSpec("nvfp4"), None, 16),
    "kvq-fp8": (QuantSpec("fp8", options={"scale": "token"}), None, 16),
    "kvq-fp8-tensor": (QuantSpec("fp8", options={"scale": "tensor"}), None, 16),
}
DECODE_STEPS = 8
CONTEXT_STEP = 8192  # the longest context is searched in whole multiples of this


def fits(model, cache_kind: tuple, batch: int, context: int, chunk: int) -> int | None:
    """The K/V bytes a static cache of `batch` rows x `context` tokens holds once it has run a `chunk`-token
    prefill and DECODE_STEPS steps (the fp16 cache under SDPA reading each K/V head once); None when that runs
    out of device memory."""
    cache = None
    try:
        spec, policy, window = cache_kind
        cache = static_cache(model, spec, batch, context, window, policy=parse_policy(policy))
        prompt = torch.randint(0, model.config.vocab_size, (batch, min(chunk, context - DECODE_STEPS)),
                               device=model.device)
        with torch.no_grad(), decode_routing(model, cache, None if spec is not None else GQA_SDPA_ATTENTION):
            generate(model, prompt, cache, DECODE_STEPS, compiled=False)
        torch.cuda.synchronize(model.device)
        return cache_bytes(cache)
    except torch.OutOfMemoryError:
        return None
    finally:
        del cache
        release_memory(model.device)


def largest(probe: Callable[[int], int | None], start: int, step: int) -> tuple[int, int | None]:
    """The largest multiple of `step` (from `start`, itself one) at which `probe` gives bytes, with them; (0,
    None) if none: doubling, then bisecting."""
    best = probe(start)
    if best is None:
        return 0, None
    good, bad = start, 2 * start
    while (held := probe(bad)) is not None:
        good, bad, best = bad, 2 * bad, held
    while bad - good > step:
        middle = (good + bad) // 2 // step * step
        if (held := probe(middle)) is not None:
            good, best = middle, held
        else:
            bad = middle
    return good, best


@contextmanager
def emulated_device(device: str, device_bytes: int | None) -> Iterator[None]:
    """PyTorch's allocator on `device` capped, while the block runs, so that it and what the process holds outside
    it now (the CUDA context, libraries' own memory) fit in `device_bytes`: a smaller device of the same kind
    emulated on a larger one. None leaves the device whole."""
    if device_bytes is None:
        yield
        return
    index = torch.device(device).index  # torch's allocator settings refuse a device without its index
    index = torch.cuda.current_device() if index is None else index
    free, total = torch.cuda.mem_get_info(index)
    outside = total - free - torch.cuda.memory_reserved(index)
    if not outside < device_bytes <= total:
        raise KvqError(f"--device-memory: {device_bytes} bytes must exceed the {outside} this process holds outside "
                       f"PyTorch's allocator and be at most the device's {total}")
    torch.cuda.set_per_process_memory_fraction((device_bytes - outside) / total, index)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)


def bench_memory(device: str, context: int, caches: tuple[str, ...], chunk: int, device_bytes: int | None = None,
                 on_rows: Callable[[dict], None] = lambda _: None,
                 progress: Callable[[str], None] = lambda _: None) -> dict:
    """Per cache: the largest batch at `context` tokens and the longest context at batch 1, with their caches'
    bytes and the device's capacity; on a device of `device_bytes` (torch's total_memory) where it is given.
    `on_rows` hears the result so far after each cache but the last; `progress`, each probe as it starts."""
    config = llama3_8b_like()
    config.max_position_embeddings = 1 << 24  # random weights: any position is as good as another
    model = decode_model(device, config)
    total = torch.cuda.get_device_properties(device).total_memory
    setting = {"model": "Llama-3-8B architecture, random fp16 weights", "prefill_chunk": chunk,
               "decode_steps": DECODE_STEPS, "device_bytes": device_bytes or total,
               "emulated_on_bytes": total if device_bytes else None,
               "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}

    def probe(name: str, batch: int, tokens: int) -> int | None:
        progress(f"{name}: {batch} x {tokens}")
        return fits(model, MEMORY_CACHES[name], batch, tokens, chunk)

    rows = []
    with emulated_device(device, device_bytes):
        for name in caches:
            batch, batch_bytes = largest(lambda b, name=name: probe(name, b, context), 1, 1)
            longest, longest_bytes = largest(lambda c, name=name: probe(name, 1, c), CONTEXT_STEP, CONTEXT_STEP)
            rows.append({"cache": name, "context": context, "largest_batch": batch,
                         "cache_bytes_at_batch": batch_bytes, "longest_context": longest,
                         "cache_bytes_at_context": longest_bytes})
            if len(rows) < len(caches):
                on_rows({**setting, "rows": list(rows)})
    return {**setting, "rows": rows}

