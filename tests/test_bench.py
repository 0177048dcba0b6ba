"""`kvq bench decode` end to end on a tiny random Llama (CPU: the fused cache takes the reference path), and its
step loop against generate."""

import pytest
import torch
from conftest import requires_cuda
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

from kvq import generate
from kvq.apply import QuantizerBank, kv_geometry
from kvq.bench import decode, tables
from kvq.gqa_attention import GQA_SDPA_ATTENTION
from kvq.quant import QuantSpec
from kvq.static_cache import StaticQuantizedCache, StaticQuantizedLayer


def test_bench_decode_times_each_step_of_each_cache_and_says_why_a_row_did_not_run():
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=256)
    result = decode.bench_decode("cpu", prompts=(40,), new_tokens=5, config=config, repeats=2, batches=(1, 2))
    for batch in (1, 2):
        rows = [row for row in result["rows"] if row["batch"] == batch]
        assert {row["cache"] for row in rows} == {cache.label for cache in decode.DECODE_CACHES}
        timed = {row["cache"]: row for row in rows if "skipped" not in row}
        skipped = {row["cache"]: row["skipped"] for row in rows if "skipped" in row}
        assert {"fp16 DynamicCache eager", "kvq fused int4 g32 eager"} <= set(timed)
        assert "CUDA only" in skipped["fp16 StaticCache compiled"]
        assert "CUDA only" in skipped["kvq int4 static compiled"]
        assert "CUDA only" in skipped["fp16 StaticCache, compiled step loop"]
        assert "CUDA only" in skipped["kvq int4 static, compiled step loop"]
        assert "CUDA only" in skipped["fp16 StaticCache compiled, SDPA enable_gqa"]
        assert "CUDA only" in skipped["fp16 StaticCache, SDPA enable_gqa, compiled step loop"]
        for row in timed.values():
            assert len(row["ms_per_token_runs"]) == 2
            assert min(row["ms_per_token_runs"]) <= row["ms_per_token"] <= max(row["ms_per_token_runs"])
            assert row["prefill_s"] > 0 and row["ms_per_token_mean"] > 0
            assert row["floor_ms"] is None and row["peak_bytes"] is None  # no copy rate or allocator stats on CPU
        fp16, kvq = timed["fp16 DynamicCache eager"], timed["kvq fused int4 g32 eager"]
        # the fp16 cache holds every token's K and V in fp16 (the last token's are never written)
        assert fp16["cache_bytes"] == fp16["kv_read_bytes"] == decode._fp16_kv_bytes(config, batch, 40 + 5 - 1)
        assert kvq["cache_bytes"] == kvq["kv_read_bytes"] > 0
        ratios = [a / b for a, b in zip(kvq["ms_per_token_runs"], fp16["ms_per_token_runs"], strict=True)]
        assert fp16["paired_ratio_to_first"] == 1.0 and fp16["speedup_vs_best_fp16"] == 1.0
        assert min(ratios) <= kvq["paired_ratio_to_first"] <= max(ratios)
        assert kvq["speedup_vs_best_fp16"] == pytest.approx(fp16["ms_per_token"] / kvq["ms_per_token"])
    assert "skipped: " in tables.decode_table(result)


def test_floor_is_weights_and_kv_over_the_copy_rate_and_speed_is_against_the_best_fp16_row():
    rows = [{"prompt": 8, "batch": 1, "cache": "a", "precision": "fp16", "ms_per_token": 4.0, "kv_read_bytes": 1e9},
            {"prompt": 8, "batch": 1, "cache": "b", "precision": "fp16", "ms_per_token": 2.0, "kv_read_bytes": 1e9},
            {"prompt": 8, "batch": 1, "cache": "c", "precision": "int4", "ms_per_token": 1.0, "kv_read_bytes": 2.5e8},
            {"prompt": 8, "batch": 1, "cache": "d", "skipped": "why"}]
    a, b, c, d = decode._with_floors(rows, weight_bytes=3e9, bandwidth=1e12)
    assert a["floor_ms"] == pytest.approx(4.0) and c["floor_ms"] == pytest.approx(3.25)
    assert a["ratio_to_floor"] == pytest.approx(1.0) and c["ratio_to_floor"] == pytest.approx(1 / 3.25)
    assert [r["speedup_vs_best_fp16"] for r in (a, b, c)] == pytest.approx([0.5, 1.0, 2.0])
    # the bytes allow c 4/3.25 of the fastest fp16 row's speed; it runs at 2x, so above its ideal
    assert [r["bytes_ideal_speedup"] for r in (a, b, c)] == pytest.approx([1.0, 1.0, 4 / 3.25])
    assert c["fraction_of_bytes_ideal"] == pytest.approx(2.0 / (4 / 3.25))
    assert "floor_ms" not in d


def test_unknown_decode_cache_is_an_error_naming_it():
    with pytest.raises(Exception, match="unknown decode cache 'fp8'"):
        decode.decode_caches(("kvq-int4", "fp8"))


def _static_cache(kind: str, model, batch: int, max_tokens: int):
    if kind in ("fp16", "fp16-gqa"):
        return StaticCache(config=model.config, max_cache_len=max_tokens)
    bank = QuantizerBank(QuantSpec("srft", 4, "per_group", 16), kv_geometry(model.config))
    return StaticQuantizedCache(bank, model.config, max_cache_len=max_tokens, window=8).allocate(model, batch)


def _wide_model(device: str):
    """A tiny random Llama whose weights are drawn wide enough that a step one position off changes its greedy
    tokens, with no EOS token (which the loop does not treat apart and generate suppresses under
    min_new_tokens), and a batch-3 prompt for it."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=101, initializer_range=0.2,
                         eos_token_id=None)
    model = LlamaForCausalLM(config).eval().to(device, torch.float16 if device == "cuda" else torch.float32)
    return model, torch.randint(1, 101, (3, 24), generator=torch.Generator().manual_seed(2)).to(device)


GPU = [requires_cuda, pytest.mark.gpu]
# The compiled step's tokens are compared whole only with the fp16 cache: with a quantized one, a last-bit
# difference between compiled and eager kernels flips a key's code now and then, and later steps attend to it,
# so on this wide-weight model the two decodes drift apart with no fault in either (the compiled step is
# checked step by step instead, below).
# "fp16-gqa": the fp16 static cache under kvq.gqa_attention's SDPA, against generate under transformers' sdpa.
STEP_LOOPS = [pytest.param("cpu", "fp16", False), pytest.param("cpu", "kvq", False),
              pytest.param("cpu", "fp16-gqa", False),
              pytest.param("cuda", "fp16", False, marks=GPU), pytest.param("cuda", "kvq", False, marks=GPU),
              pytest.param("cuda", "fp16", True, marks=GPU), pytest.param("cuda", "fp16-gqa", True, marks=GPU)]


def _attention(kind: str) -> str | None:
    return GQA_SDPA_ATTENTION if kind == "fp16-gqa" else None


@pytest.mark.parametrize(("device", "kind", "compiled"), STEP_LOOPS)
@pytest.mark.parametrize("chunk", [None, 10])
def test_the_step_loop_decodes_generates_greedy_tokens(device, kind, compiled, chunk):
    """greedy_step_loop (its plain step, or the compiled one replayed as a CUDA graph) against generate run
    eagerly with the same kind of static cache and the model's own attention: the same 48 tokens at batch 3, the
    prompt prefilled whole or in chunks."""
    model, prompt = _wide_model(device)
    steps = 48
    runs, marks = {}, []
    for loop in ("generate", "step"):
        cache = _static_cache(kind, model, 3, 24 + steps)
        attention = _attention(kind) if loop == "step" else None
        with torch.no_grad(), generate.decode_routing(model, cache, attention):
            if loop == "step":
                runs[loop] = generate.greedy_step_loop(model, cache, prompt, steps, chunk, compiled=compiled,
                                                    on_token=lambda: marks.append(1))
            else:
                runs[loop] = model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache,
                                            max_new_tokens=steps, do_sample=False, prefill_chunk_size=chunk,
                                            disable_compile=True)[:, 24:]
    assert runs["step"].shape == (3, steps) and len(marks) == steps
    assert torch.equal(runs["step"], runs["generate"])


def _cache_state(cache) -> list[torch.Tensor]:
    """Every tensor the layers of a static cache keep, in a fixed order: what a decode step reads and writes."""
    state = []
    for layer in cache.layers:
        if isinstance(layer, StaticQuantizedLayer):
            state += layer._tensors()
        else:
            state += [value for _, value in sorted(vars(layer).items()) if isinstance(value, torch.Tensor)]
    return state


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("kind", ["fp16", "kvq"])
def test_the_compiled_step_picks_the_plain_steps_token_from_the_same_cache(kind):
    """The step loop's compiled step (a CUDA graph, under the loop's compile options) against a plain forward,
    47 decode steps on the wide-weight model with a batch of 3, each step taken from the same cache state: the
    plain cache's tensors are copied into the compiled step's before it, so the two differ only by one step's
    rounding, which cannot compound through flipped codes. The compiled step's token is the plain step's
    argmax wherever the plain logits' top two are further apart than rounding moves them."""
    model, prompt = _wide_model("cuda")
    steps, margin = 47, 0.1
    plain, graphed = (_static_cache(kind, model, 3, 24 + steps + 1) for _ in range(2))
    # as in the loop: past its graph limit dynamo would fall back to the plain step without saying so
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=generate.STEP_GRAPHS,
                                                     fail_on_recompile_limit_hit=True):
        for cache in (plain, graphed):  # the loop's prefill alone: its first token, no step
            with generate.decode_routing(model, cache):
                token = generate.greedy_step_loop(model, cache, prompt, 1, compiled=False)
        compared = 0
        for step in range(steps):
            position = torch.tensor([24 + step], device="cuda")
            for source, target in zip(_cache_state(plain), _cache_state(graphed), strict=True):
                target.copy_(source)
            with generate.decode_routing(model, graphed):
                compiled_token = generate._compiled_greedy_step()(model, graphed, token, position).clone()
            with generate.decode_routing(model, plain):
                logits = model(input_ids=token, position_ids=position[None], cache_position=position,
                               past_key_values=plain, use_cache=True).logits[:, -1]
            top_two = logits.float().topk(2).values
            clear = top_two[:, 0] - top_two[:, 1] > margin
            assert torch.equal(compiled_token[clear], logits.argmax(-1, keepdim=True)[clear]), step
            compared += int(clear.sum())
            token = logits.argmax(-1, keepdim=True)
    assert compared >= 0.75 * 3 * steps  # the margin leaves most tokens compared


@pytest.mark.parametrize(("device", "compiled"), [("cpu", False), pytest.param("cuda", True, marks=GPU)])
@pytest.mark.parametrize("kind", ["fp16", "kvq"])
def test_a_cache_reused_through_reset_decodes_each_prompt_as_a_fresh_cache_does(device, compiled, kind):
    """The step loop over one cache reset between prompts gives each prompt the tokens a fresh cache gives it
    (nothing the last prompt wrote leaks into the next), and under the compiled step the reset cache replays
    the CUDA graph its first prompt recorded, where a fresh cache makes the step record another."""
    model, first = _wide_model(device)
    prompts = (first, torch.randint(1, 101, first.shape, generator=torch.Generator().manual_seed(3)).to(device))

    def decode(cache, prompt):
        with torch.no_grad(), generate.decode_routing(model, cache):
            return generate.greedy_step_loop(model, cache, prompt, 24, compiled=compiled)

    # The fresh caches stay alive while the reused one is allocated: a freed one's device addresses could be
    # handed to it, and the compiled step would then replay that cache's graph instead of recording one.
    fresh_caches = [_static_cache(kind, model, 3, 48) for _ in prompts]
    fresh = [decode(fresh_cache, prompt) for fresh_cache, prompt in zip(fresh_caches, prompts, strict=True)]
    cache = _static_cache(kind, model, 3, 48)
    reused, recorded = [], []
    for prompt in prompts:
        cache.reset()
        before = generate.graphs_recorded()
        reused.append(decode(cache, prompt))
        recorded.append(generate.graphs_recorded() - before)
    assert not torch.equal(fresh[0], fresh[1])
    for got, want in zip(reused, fresh, strict=True):
        assert torch.equal(got, want)
    if compiled:
        assert recorded[0] > 0 and recorded[1] == 0
