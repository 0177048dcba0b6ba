"""Generation over a cache, as gpt-fast runs it: the prompts prefilled eagerly (in chunks if asked), then one step per
token, compiled on CUDA (a CUDA graph per step) with every input kept on the device, so the host queues the next
step while the current one runs. Greedy or sampled (temperature, top-k, top-p), stop tokens, prompts of different
lengths (left-padded, with the attention mask every path honours), a callback per token for streaming.
`decode_routing` gives the context a decode with a cache runs in (kvq's fused attention for kvq's caches)."""

import functools
import inspect
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from kvq.errors import KvqError
from kvq.gqa_attention import GQA_SDPA_ATTENTION, gqa_sdpa
from kvq.static_cache import StaticQuantizedCache, reading_written

# A CUDA graph per step ("reduce-overhead"), with cuBLAS running the weight matmuls, so that every cache's step runs
# the same model kernels and a rerun runs them again.
STEP_COMPILE_OPTIONS = {"triton.cudagraphs": True}
# gpt-fast's settings add coordinate-descent tuning, under which inductor turns one-row matmuls (batch-1 decode's
# weight GEMVs) into reductions whose launch configurations it picks by timing them as it compiles. Those timings
# need not match the kernel's time inside the step, so two compiles of one model (two caches' steps) can pick
# configurations whose speeds differ: at best faster than cuBLAS's GEMVs, but a row's speed then also measures
# which configurations its compile picked.
TUNED_GEMV_COMPILE_OPTIONS = {**STEP_COMPILE_OPTIONS, "coordinate_descent_tuning": True}
# Graphs the step may hold: (caches) x (prompt lengths) x (batches) x (masked or not) of one process; past
# dynamo's default limit it would fall back to eager without saying so.
STEP_GRAPHS = 64
# Steps between looks at whether every sequence has stopped: each look waits for the device.
STOP_POLL = 16


@dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy (argmax). Otherwise a draw from softmax(logits / temperature) over the `top_k` most
    likely tokens (None: all) and, of those, the smallest set whose probability reaches `top_p`; `seed` seeds the
    draws, so a seeded generation repeats on one device."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise KvqError(f"--temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise KvqError(f"--top-k must be at least 1, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise KvqError(f"--top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row of (B, V) logits, as (B, 1)."""
    if sampling.greedy:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        beyond = probs.cumsum(-1) - probs >= sampling.top_p  # the mass before a token already reaches top_p
        logits = logits.scatter(-1, order, ordered.masked_fill(beyond, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)


def cache_keyword(model) -> str:
    """The name forward takes the cache by: transformers 5.2x renamed `past_key_values` to `cache` (warning on the
    old name), earlier releases know only the old one."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def _logits(model, cache, tokens, cache_position, positions, mask, keyword) -> torch.Tensor:
    # positions given both ways: transformers releases differ in which of the two they read
    return model(input_ids=tokens, attention_mask=mask, position_ids=positions, cache_position=cache_position,
                 use_cache=True, logits_to_keep=1, **{keyword: cache}).logits[:, -1]


def _greedy_step(model, cache, token, cache_position, positions, mask, keyword) -> torch.Tensor:
    return _logits(model, cache, token, cache_position, positions, mask, keyword).argmax(-1, keepdim=True)


@functools.cache
def _compiled(step, tuned_gemv: bool):
    # one graph per model, cache type and shape (no dynamic shapes: CUDA graphs need fixed ones); dynamo keeps the
    # two settings' graphs apart, since each compiles through its own backend. No default for tuned_gemv: the cache
    # would key _compiled(step) and _compiled(step, False) apart, two backends compiling the same graphs.
    options = TUNED_GEMV_COMPILE_OPTIONS if tuned_gemv else STEP_COMPILE_OPTIONS
    return torch.compile(step, options=options, fullgraph=True, dynamic=False)


def _capacity(cache) -> int | None:
    """The tokens a static cache holds (None for a cache that grows): its full-attention layers' length."""
    lengths = [layer.max_cache_len for layer in getattr(cache, "layers", ())
               if not getattr(layer, "is_sliding", False) and getattr(layer, "max_cache_len", None)]
    return min(lengths) if lengths else None


def left_padded(prompts: torch.Tensor | Sequence[Sequence[int] | torch.Tensor], pad_token_id: int,
                device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, L) token ids, the shorter prompts padded on the left, and the (B, L) mask of real tokens (None when
    every prompt has length L)."""
    if isinstance(prompts, torch.Tensor) and prompts.dim() == 2:
        rows = list(prompts)
    else:
        rows = [torch.as_tensor(p, dtype=torch.long) for p in prompts]
    if not rows:
        raise KvqError("--prompt: give at least one prompt")
    for index, row in enumerate(rows):
        if row.dim() != 1 or row.numel() == 0:
            raise KvqError(f"--prompt {index + 1} is empty: every prompt needs at least one token")
    length = max(row.numel() for row in rows)
    ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, length - row.numel():] = row.to(device)
        mask[i, length - row.numel():] = 1
    return ids, (None if bool(mask.all()) else mask)


def generate(model, prompts, cache, max_new_tokens: int, *, sampling: Sampling = Sampling(),
             stop_tokens: Sequence[int] = (), pad_token_id: int = 0, prefill_chunk: int | None = None,
             on_token: Callable[[torch.Tensor], None] | None = None,
             compiled: bool | None = None, tuned_gemv: bool = False) -> list[torch.Tensor]:
    """Up to `max_new_tokens` tokens after each prompt, decoded through `cache` (a fresh or reset() cache).

    `prompts`: a (B, L) tensor, or B sequences of token ids of any lengths (left-padded with `pad_token_id` and
    masked). Each row stops after its first token in `stop_tokens`; the loop ends once every row has. `on_token`
    gets each step's (B, 1) tokens on the device as they are queued (a stopped row repeats `pad_token_id`).
    `compiled` (default: on CUDA) compiles the step: decode prompt after prompt with one static cache, reset()
    between them, since each fresh cache makes the step record (and keep) another CUDA graph. `tuned_gemv`
    compiles it with gpt-fast's coordinate-descent tuning instead (TUNED_GEMV_COMPILE_OPTIONS).
    Returns each row's new tokens, through its stop token if it met one. Run it under `decode_routing` for kvq's
    caches and under torch.no_grad()."""
    device = model.device
    if max_new_tokens < 1:
        raise KvqError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise KvqError(f"--prefill-chunk must be a positive number of tokens, got {prefill_chunk}")
    ids, real = left_padded(prompts, pad_token_id, device)
    batch, length = ids.shape
    capacity = _capacity(cache)
    if capacity is not None and length + max_new_tokens - 1 > capacity:
        raise KvqError(f"the cache holds {capacity} tokens; a {length}-token prompt and {max_new_tokens} new tokens "
                       f"need {length + max_new_tokens - 1}")
    # Masks cover the cache's whole length for a static cache (later slots are masked by causality), the written
    # positions for one that grows; padded rows count positions from their first real token, as generate does.
    mask = None
    if real is not None:
        mask = torch.ones(batch, capacity or length + max_new_tokens, dtype=torch.long, device=device)
        mask[:, :length] = real
        positions = (real.cumsum(-1) - 1).masked_fill(real == 0, 1)
    else:
        positions = torch.arange(length, device=device).expand(batch, length)
    chunk = prefill_chunk or length
    keyword = cache_keyword(model)
    with reading_written(cache):
        for start in range(0, length, chunk):
            end = min(start + chunk, length)
            visible = None if mask is None else mask[:, :capacity or end]
            logits = _logits(model, cache, ids[:, start:end], torch.arange(start, end, device=device),
                             positions[:, start:end], visible, keyword)
    generator = None if sampling.greedy else torch.Generator(device=device).manual_seed(sampling.seed)
    token = choose(logits, sampling, generator)
    stops = torch.tensor(list(stop_tokens), dtype=torch.long, device=device)
    done = torch.isin(token[:, 0], stops)
    generated = [token]
    if on_token:
        on_token(token)
    compiled = device.type == "cuda" if compiled is None else compiled
    step = _greedy_step if sampling.greedy else _logits
    step = _compiled(step, tuned_gemv) if compiled else step
    cache_position = torch.tensor([length], device=device)
    row_position = positions[:, -1:] + 1
    with torch._dynamo.config.patch(recompile_limit=STEP_GRAPHS, fail_on_recompile_limit_hit=True):
        for i in range(1, max_new_tokens):
            if stops.numel() and i % STOP_POLL == 0 and bool(done.all()):
                break
            visible = None if mask is None else mask[:, :capacity or length + i]
            # cloned: a CUDA graph reuses its output buffer at the next replay
            out = step(model, cache, token, cache_position, row_position, visible, keyword).clone()
            token = out if sampling.greedy else choose(out, sampling, generator)
            token = token.masked_fill(done[:, None], pad_token_id)
            done |= torch.isin(token[:, 0], stops)
            cache_position += 1
            row_position += 1
            generated.append(token)
            if on_token:
                on_token(token)
    return _through_stop(torch.cat(generated, dim=1), stops)


def _through_stop(tokens: torch.Tensor, stops: torch.Tensor) -> list[torch.Tensor]:
    rows = []
    for row in tokens:
        hits = torch.isin(row, stops).nonzero()
        rows.append(row[: int(hits[0]) + 1] if len(hits) else row)
    return rows


def static_cache(model, spec, batch: int, max_cache_len: int, window: int = 16, policy=None,
                 fit_center: Callable | None = None):
    """A static cache for `batch` rows of `max_cache_len` tokens: transformers' StaticCache for fp (spec None), else
    kvq's StaticQuantizedCache, the newest `window` tokens exact (all of them in a shorter cache; packed layouts
    only), its layers following `policy` (a kvq.policy.SitePolicy: per-layer and per-role settings, exact layers).
    A bank that centers keys is given its offsets by `fit_center(bank)` first. On CUDA every quantized layer's
    layouts must have a fused decode kernel (KvqError otherwise)."""
    from transformers import StaticCache

    from kvq.apply import QuantizerBank, kv_geometry
    from kvq.policy import SitePolicy

    if spec is None:
        return StaticCache(config=model.config, max_cache_len=max_cache_len)
    bank = QuantizerBank(spec, kv_geometry(model.config), policy=policy or SitePolicy())
    if bank.key_centers and fit_center is not None:
        fit_center(bank)
    cache = StaticQuantizedCache(bank, model.config, max_cache_len, min(window, max_cache_len))
    if model.device.type == "cuda":  # a CPU runs the reference throughout; a GPU without a kernel would crawl
        reason = cache.decode_kernel_reason(model.config.get_text_config(decoder=True).num_attention_heads)
        if reason is not None:
            raise KvqError(f"--quant {spec.quantizer}:{spec.bits}: no fused decode kernel on {model.device}: {reason} "
                           "(--device cpu runs the reference)")
    return cache.allocate(model, batch)


def complete(lm, prompts: Sequence[str], spec, max_new_tokens: int, *, sampling: Sampling = Sampling(),
             stop: Sequence[str] | None = None, window: int = 16, prefill_chunk: int | None = None,
             on_text: Callable[[str], None] | None = None, policy=None,
             center_corpus: str = "shakespeare") -> list[str]:
    """Each prompt's continuation (text) from a kvq.models.LoadedModel through a static cache (`static_cache`, its
    layers following `policy`); fp decodes under kvq.gqa_attention's SDPA, which reads each K/V head once. `stop`:
    strings of one token each (None: the tokenizer's end-of-sequence token). `on_text` streams a single prompt's
    text as it is decoded. Keys centered by their mean (center: post_rope_mean) take it from `center_corpus`'s
    calibration split (kvq.data)."""
    from kvq.data import DataSpec
    from kvq.experiment import fit_center

    tokenizer = lm.tokenizer
    ids = [tokenizer(prompt)["input_ids"] for prompt in prompts]
    stop_ids = [tokenizer.eos_token_id] if stop is None and tokenizer.eos_token_id is not None else []
    for text in stop or ():
        encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(encoded) != 1:
            raise KvqError(f"--stop {text!r} is {len(encoded)} tokens; a stop string must be one token")
        stop_ids += encoded
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    longest = max((len(row) for row in ids), default=0)
    cache = static_cache(lm.model, spec, len(ids), longest + max_new_tokens, window, policy,
                         lambda bank: fit_center(bank, lm, DataSpec(corpus=center_corpus), "cache"))
    shown: list[int] = []
    text = ""

    def stream(token: torch.Tensor) -> None:
        # the whole text is decoded again (a token alone may be half a character); only what it adds is sent
        nonlocal text
        shown.append(int(token[0, 0]))
        longer = tokenizer.decode(shown, skip_special_tokens=True)
        on_text(longer[len(text):])
        text = longer

    with torch.no_grad(), decode_routing(lm.model, cache, None if spec is not None else GQA_SDPA_ATTENTION):
        rows = generate(lm.model, ids, cache, max_new_tokens, sampling=sampling, stop_tokens=stop_ids,
                        pad_token_id=pad, prefill_chunk=prefill_chunk,
                        on_token=stream if on_text and len(ids) == 1 else None)
    return [tokenizer.decode(row, skip_special_tokens=True) for row in rows]


def graphs_recorded() -> int:
    """CUDA graphs inductor has recorded in this process (a compiled step records one per new set of cache
    buffers)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_recorded_non_static_inputs"]


def decode_routing(model, cache, attention: str | None = None):
    """The context a decode with `cache` runs in: kvq's fused attention for kvq's caches, else the attention
    implementation named (only kvq.gqa_attention's is known), else none."""
    from kvq.cache import QuantizedKVCache, fused_decoding

    if isinstance(cache, (QuantizedKVCache, StaticQuantizedCache)):
        return fused_decoding(model, cache)
    if attention == GQA_SDPA_ATTENTION:
        return gqa_sdpa(model)
    if attention is not None:
        raise KvqError(f"unknown decode attention {attention!r}; known: {GQA_SDPA_ATTENTION}")
    return nullcontext()
