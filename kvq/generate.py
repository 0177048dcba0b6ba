"""Fast greedy decoding over a static cache, as gpt-fast runs it: an eager prefill, then one compiled step per token
whose inputs stay on the device. `decode_routing` gives the context a decode with a cache runs in."""

import functools
from collections.abc import Callable
from contextlib import nullcontext

import torch

from kvq.errors import KvqError
from kvq.gqa_attention import GQA_SDPA_ATTENTION, gqa_sdpa


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
