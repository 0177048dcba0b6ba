"""`kvq bench decode`: ms/token of every decode path a user would pick (HF generate with fp16 dynamic and compiled
static caches, the fair fp16 static cache of kvq.gqa_attention, kvq's caches, transformers' quantized caches, and
kvq.generate's compiled step loop over the static caches) on a random-init model of a real architecture config,
each row beside its bandwidth floor and its bytes-ideal speedup."""

import gc
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvq.bench.timing import copy_bandwidth
from kvq.errors import KvqError
from kvq.generate import decode_routing, generate, static_cache
from kvq.gqa_attention import GQA_SDPA_ATTENTION


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
    loop: str = "generate"  # "generate": HF generate; "step": kvq.generate.generate, a compiled step per token
    attention: str | None = None  # an attention implementation the row runs under (None: the model's own)
    tuned_gemv: bool = False  # a "step" row compiled with gpt-fast's coordinate-descent tuning (kvq.generate)


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


# The per-site policies of static rows (kvq.policy's YAML form): Qwen2's fp boundary layers; vLLM's K8/V4 mix;
# asymmetric codes (unsigned, an fp16 scale and offset per group: as many bytes as fp32 scales alone).
FP_BOUNDARY = {"layers": [{"first": 1, "use": "fp"}, {"last": 1, "use": "fp"}]}
K8_V4 = {"k": {"bits": 8}}
ASYMMETRIC = {role: {"symmetric": False, "scale_dtype": "float16"} for role in ("k", "v")}


def _kvq_static(policy: dict | None = None, quantizer: tuple = ("srft", 4, "per_group", 32),
                window: int = 16, options: dict | None = None) -> Callable[..., dict]:
    """kvq's static cache with a window of `window` exact tokens, of QuantSpec(*quantizer, options=options) (SRFT int4
    in groups of 32), its sites following `policy`."""
    def setup(model, batch: int, max_tokens: int) -> dict:
        from kvq.policy import parse_policy
        from kvq.quant import QuantSpec

        _compiled_on_cuda(model)
        spec = QuantSpec(*quantizer, options=options or {})
        return {"past_key_values": static_cache(model, spec, batch, max_tokens, window, policy=parse_policy(policy))}

    return setup


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
    _compiled_on_cuda(model)
    return {"past_key_values": static_cache(model, None, batch, max_tokens)}


# kvq's static caches, (name, label, precision, setup): each is a row in HF generate's loop (NAME-static-compiled)
# and in kvq.generate's compiled step loop (NAME-static-step)
KVQ_STATIC_LAYOUTS = (
    ("kvq-int4", "kvq int4", "int4", _kvq_static()),
    ("kvq-int4-fp-boundary", "kvq int4, first and last layers fp16", "int4+fp", _kvq_static(FP_BOUNDARY)),
    ("kvq-k8v4", "kvq int8 K, int4 V", "k8v4", _kvq_static(K8_V4)),
    ("kvq-int4-asym", "kvq asymmetric int4", "int4-asym", _kvq_static(ASYMMETRIC)),
    # KIVI: keys per channel over 32-token groups, which the exact window must hold
    ("kvq-kivi4", "kvq KIVI-4 g32, window 32", "kivi4", _kvq_static(quantizer=("kivi", 4, "per_token", 32), window=32)),
    ("kvq-kivi2", "kvq KIVI-2 g32, window 32", "kivi2", _kvq_static(quantizer=("kivi", 2, "per_token", 32), window=32)),
    # TurboQuant_mse: SRFT, then Lloyd-Max level indices and an fp16 norm per token
    ("kvq-turbo4", "kvq TurboQuant_mse-4", "turbo4", _kvq_static(quantizer=("turbo", 4))),
    ("kvq-turbo3", "kvq TurboQuant_mse-3", "turbo3", _kvq_static(quantizer=("turbo", 3))),
    # Formats engines ship: the OCP MX spec's fp4 (an E8M0 scale per 32), NVIDIA's NVFP4 (an E4M3 scale per 16 and
    # one per layer) and vLLM's fp8 e4m3, with per-token scales or, as vLLM runs it, one calibrated scale per layer
    ("kvq-mxfp4", "kvq MXFP4 (e2m1, E8M0 per 32)", "mxfp4", _kvq_static(quantizer=("mx",))),
    ("kvq-nvfp4", "kvq NVFP4 (e2m1, E4M3 per 16, fp32 per layer)", "nvfp4", _kvq_static(quantizer=("nvfp4",))),
    ("kvq-fp8", "kvq FP8 e4m3, fp32 scale per token", "fp8",
     _kvq_static(quantizer=("fp8",), options={"scale": "token"})),
    ("kvq-fp8-tensor", "kvq FP8 e4m3, one calibrated scale per layer", "fp8",
     _kvq_static(quantizer=("fp8",), options={"scale": "tensor"})),
)


def _kvq_static_rows() -> tuple[DecodeCache, ...]:
    return tuple(row for name, label, precision, setup in KVQ_STATIC_LAYOUTS for row in (
        DecodeCache(f"{name}-static-compiled", f"{label}, static, compiled", precision, setup),
        DecodeCache(f"{name}-static-step", f"{label}, static, compiled step loop", precision, setup, loop="step")))


DECODE_CACHES = (  # the first is the paired ratios' baseline
    DecodeCache("fp16-dynamic", "fp16 DynamicCache eager", "fp16", _fp16_dynamic),
    DecodeCache("fp16-static-compiled", "fp16 StaticCache compiled", "fp16", _fp16_static_compiled),
    DecodeCache("kvq-int4", "kvq fused int4 g32 eager", "int4", _kvq_int4),
    DecodeCache("quanto-int4", "transformers QuantizedCache quanto int4", "int4", _transformers_quantized("quanto")),
    DecodeCache("hqq-int4", "transformers QuantizedCache hqq int4", "int4", _transformers_quantized("hqq")),
    DecodeCache("fp16-static-step", "fp16 StaticCache, compiled step loop", "fp16", _fp16_static, loop="step"),
    *_kvq_static_rows(),
    # The fair fp16 rows: SDPA reads each K/V head once (transformers' sdpa repeats it per query head under the
    # static cache's mask, see kvq.gqa_attention).
    DecodeCache("fp16-gqa-static-compiled", "fp16 StaticCache compiled, SDPA enable_gqa", "fp16",
                _fp16_static_compiled, attention=GQA_SDPA_ATTENTION),
    DecodeCache("fp16-gqa-static-step", "fp16 StaticCache, SDPA enable_gqa, compiled step loop", "fp16", _fp16_static,
                loop="step", attention=GQA_SDPA_ATTENTION),
    # and the same step compiled as gpt-fast compiles it, whose batch-1 GEMVs can run faster than the other rows'
    DecodeCache("fp16-gqa-static-step-tuned", "fp16 StaticCache, SDPA enable_gqa, compiled step loop, tuned GEMVs",
                "fp16", _fp16_static, loop="step", attention=GQA_SDPA_ATTENTION, tuned_gemv=True),
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


def cache_bytes(cache) -> int | None:
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

    def tick(self, _tokens=None) -> None:
        """Marks a token (kvq.generate.generate's on_token passes the tokens, unread)."""
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


def decode_run(model, row: DecodeCache, kwargs: dict, prompt: torch.Tensor, tokens: int,
               prefill_chunk: int | None = None) -> _Run:
    """One greedy decode of `tokens` tokens as `row` decodes (its loop, attention and step compilation; see
    DecodeCache) with generate's keyword arguments `kwargs` (the cache, from the row's setup), the prompt
    prefilled in chunks of `prefill_chunk` tokens if given."""
    from transformers import LogitsProcessorList

    cache = kwargs.get("past_key_values")
    cuda = prompt.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(prompt.device)
    with torch.no_grad(), decode_routing(model, cache, row.attention):
        _synchronize(prompt.device)
        clock = StepClock(prompt.device)
        if row.loop == "step":
            generate(model, prompt, cache, tokens, prefill_chunk=prefill_chunk, on_token=clock.tick, compiled=True,
                     tuned_gemv=row.tuned_gemv)
        else:
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens,
                           min_new_tokens=tokens, do_sample=False, logits_processor=LogitsProcessorList([clock]),
                           prefill_chunk_size=prefill_chunk, **kwargs)
    prefill_s, steps_s = clock.seconds()
    held = cache_bytes(cache if cache is not None else getattr(model, "_cache", None))
    peak = torch.cuda.max_memory_allocated(prompt.device) if cuda else None
    return _Run(prefill_s, steps_s, held, peak)


def warmup_prompt(prompt: torch.Tensor, prefill_chunk: int | None, kwargs: dict) -> torch.Tensor:
    """The prompt a row's untimed warm-up decodes with generate's keyword arguments `kwargs`: its first prefill chunk
    alone where the prefill is chunked into a cache of fixed shapes (a compileable one, allocated whole for the
    run's tokens), else the whole prompt. A decode step over such a cache compiles to the same graph and kernels
    however many tokens it holds, and every chunk's memory peak is the first's, so the short warm-up still compiles
    what the timed runs run and still finds a row that does not fit; at long contexts the prefill it skips is most
    of a row's time. A cache that grows with the prompt, or one generate builds for the prompt's length, warms up on
    the whole prompt."""
    held = kwargs.get("past_key_values")
    if prefill_chunk is None or not getattr(held, "is_compileable", False):
        return prompt
    return prompt[:, :prefill_chunk]


def warm_up(model, cache: DecodeCache, prompt: torch.Tensor, max_tokens: int, tokens: int,
            prefill_chunk: int | None) -> None:
    """One untimed decode of `tokens` tokens through a fresh `cache` row of `max_tokens` tokens, from warmup_prompt:
    allocator and kernel warm-up, and a compiled row's compilation. Raises what the row's setup or run raises."""
    kwargs = cache.setup(model, prompt.shape[0], max_tokens)
    decode_run(model, cache, kwargs, warmup_prompt(prompt, prefill_chunk, kwargs), tokens, prefill_chunk)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _decode_rows(model, caches: tuple[DecodeCache, ...], prompt: torch.Tensor, new_tokens: int,
                 repeats: int, prefill_chunk: int | None, progress: Callable[[str], None],
                 on_run: Callable[[list[dict]], None] = lambda _: None) -> list[dict]:
    """Per cache: median step time over `repeats` generates of new_tokens tokens. Each cache first runs
    one untimed generate of as many tokens (warm_up); then the caches take turns run by run, with Python's garbage
    collector held off, so drift in the host's speed (runs of one cache vary by 2x on a shared host) falls on all of
    them alike.
    A cache that cannot run (unavailable here, or out of memory) gives a row that says why. `progress` hears of
    each warm-up and each round of turns as it starts; `on_run` hears the rows so far after every timed run but the
    last, so a bench stopped inside a round keeps the caches it timed there."""
    batch, length = prompt.shape
    max_tokens = length + new_tokens
    where = {"prompt": length, "batch": batch}
    skipped, ready = [], []
    for cache in caches:
        progress(f"prompt {length} x {batch}: warming up {cache.name}")
        try:
            warm_up(model, cache, prompt, max_tokens, new_tokens, prefill_chunk)
            ready.append(cache)
        except CacheUnavailable as exc:
            skipped.append({**where, "cache": cache.label, "skipped": str(exc)})
        except torch.OutOfMemoryError:
            skipped.append({**where, "cache": cache.label, "skipped": f"out of memory at batch {batch}"})
        release_memory(prompt.device)
    runs: dict[str, list[_Run]] = {cache.label: [] for cache in ready}
    collecting = gc.isenabled()
    gc.disable()
    try:
        for repeat in range(repeats):
            progress(f"prompt {length} x {batch}: timed round {repeat + 1}/{repeats} of {len(ready)} caches")
            for turn, cache in enumerate(ready):
                runs[cache.label].append(decode_run(model, cache, cache.setup(model, batch, max_tokens), prompt,
                                                     new_tokens, prefill_chunk))
                if repeat + 1 < repeats or turn + 1 < len(ready):
                    on_run(_timed_rows(model, ready, runs, prompt) + skipped)
    finally:
        if collecting:
            gc.enable()
    return _timed_rows(model, ready, runs, prompt) + skipped


def _timed_rows(model, ready: list[DecodeCache], runs: dict[str, list[_Run]], prompt: torch.Tensor) -> list[dict]:
    """A row per cache from its timed runs so far; a cache not yet timed has none."""
    batch, length = prompt.shape
    run_medians = {label: [statistics.median(run.steps_s) * 1e3 for run in timed] for label, timed in runs.items()}
    baseline = run_medians[ready[0].label] if ready else []
    rows = []
    for cache in ready:
        timed = runs[cache.label]
        if not timed:
            continue
        steps = [step for run in timed for step in run.steps_s]
        held = timed[-1].held_bytes
        rows.append({
            "prompt": length, "batch": batch, "cache": cache.label, "precision": cache.precision,
            "ms_per_token": statistics.median(steps) * 1e3, "ms_per_token_mean": statistics.mean(steps) * 1e3,
            "ms_per_token_runs": run_medians[cache.label],
            # runs of one repeat are adjacent in time, so their ratio cancels most of the host's drift; in a round
            # still running the first cache has a run that a later one does not have yet
            "paired_ratio_to_first": statistics.median(a / b for a, b in zip(run_medians[cache.label], baseline,
                                                                              strict=False)),
            "prefill_s": statistics.median(run.prefill_s for run in timed),
            "cache_bytes": held,
            # K/V a step reads: what the cache holds, or for an fp16 cache of unknown layout the prompt's fp16 K/V
            "kv_read_bytes": held if held is not None else (
                _fp16_kv_bytes(model.config, batch, length) if cache.precision == "fp16" else None),
            "peak_bytes": max((run.peak_bytes for run in timed if run.peak_bytes is not None), default=None),
        })
    return rows


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
                 prefill_chunk: int | None = None, progress: Callable[[str], None] = lambda _: None,
                 on_rows: Callable[[dict], None] = lambda _: None) -> dict:
    """ms/token per cache and decode loop at each prompt length and batch (see _decode_rows), on a random-weight
    fp16 Llama of `config` (Llama-3-8B's by default); every cache prefills in chunks of `prefill_chunk` tokens
    (generate's prefill_chunk_size) if given. `progress` hears what starts, as a line; `on_rows` hears the result
    so far after each timed run and each prompt and batch, so a caller can keep what an interrupted bench
    measured (a row's `ms_per_token_runs` says how many rounds it has)."""
    model = decode_model(device, config or llama3_8b_like())
    config = model.config
    bandwidth = copy_bandwidth(device) if device.startswith("cuda") else None
    weight_bytes = _weight_read_bytes(model)
    rows = []

    def result(running: Sequence[dict] = ()) -> dict:
        """The finished prompts' and batches' rows, then the rows of one still running."""
        return {"model": "Llama-3-8B architecture, random fp16 weights", "new_tokens": new_tokens,
                "repeats": repeats, "prefill_chunk": prefill_chunk, "copy_bandwidth_Bps": bandwidth,
                "rows": list(_with_floors(rows + list(running), weight_bytes, bandwidth))}

    for batch in batches:
        for length in prompts:
            prompt = torch.randint(0, config.vocab_size, (batch, length), device=device)
            rows += _decode_rows(model, caches, prompt, new_tokens, repeats, prefill_chunk, progress,
                                 on_run=lambda partial: on_rows(result(partial)))
            release_memory(prompt.device)
            on_rows(result())
    return result()
