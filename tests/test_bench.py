"""`kvq bench decode` end to end on a tiny random Llama (CPU: the fused cache takes the reference path), and its
step loop against generate."""

import pytest
import torch
from conftest import requires_cuda
from transformers import LlamaConfig

from kvq.bench import decode, tables


def test_bench_decode_times_each_step_of_each_cache_and_says_why_a_row_did_not_run():
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=256)
    heard, so_far = [], []
    result = decode.bench_decode("cpu", prompts=(40,), new_tokens=5, config=config, repeats=2, batches=(1, 2),
                                 progress=heard.append, on_rows=so_far.append)
    # the rows so far after each timed run but a prompt and batch's last, then as each prompt and batch ends: a
    # cache's row appears with its first run and gains a run a round, the rows of an earlier batch kept whole
    skipped_at_batch_1 = {row["cache"] for row in result["rows"] if "skipped" in row and row["batch"] == 1}
    ready = [cache.label for cache in decode.DECODE_CACHES if cache.label not in skipped_at_batch_1]
    assert len(so_far) == 2 * 2 * len(ready) and so_far[-1] == result
    finished = {(row["batch"], row["cache"]): row for row in result["rows"]}
    for batch in (1, 2):
        for run, partial in enumerate(so_far[(batch - 1) * 2 * len(ready):batch * 2 * len(ready)], start=1):
            assert [row for row in partial["rows"] if row["batch"] < batch] == [
                row for row in result["rows"] if row["batch"] < batch]
            timed = [row for row in partial["rows"] if row["batch"] == batch and "skipped" not in row]
            turns = [(run > turn) + (run > len(ready) + turn) for turn in range(len(ready))]
            assert [row["cache"] for row in timed] == [label for label, done in zip(ready, turns, strict=True) if done]
            for row, done in zip(timed, turns, strict=False):  # the timed caches are the first of `ready`
                assert row["ms_per_token_runs"] == finished[batch, row["cache"]]["ms_per_token_runs"][:done]
    # a warm-up per cache, then each round of turns, as each starts
    assert heard[:len(decode.DECODE_CACHES)] == [f"prompt 40 x 1: warming up {cache.name}"
                                                 for cache in decode.DECODE_CACHES]
    assert heard[len(decode.DECODE_CACHES):len(decode.DECODE_CACHES) + 2] == [
        f"prompt 40 x 1: timed round {i}/2 of {len(ready)} caches" for i in (1, 2)]
    assert len(heard) == 2 * (len(decode.DECODE_CACHES) + 2)
    for batch in (1, 2):
        rows = [row for row in result["rows"] if row["batch"] == batch]
        assert {row["cache"] for row in rows} == {cache.label for cache in decode.DECODE_CACHES}
        timed = {row["cache"]: row for row in rows if "skipped" not in row}
        skipped = {row["cache"]: row["skipped"] for row in rows if "skipped" in row}
        assert {"fp16 DynamicCache eager", "kvq fused int4 g32 eager"} <= set(timed)
        assert "CUDA only" in skipped["fp16 StaticCache compiled"]
        assert "CUDA only" in skipped["kvq int4, static, compiled"]
        assert "CUDA only" in skipped["fp16 StaticCache, compiled step loop"]
        assert "CUDA only" in skipped["kvq int4, static, compiled step loop"]
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


def test_an_interrupted_decode_bench_keeps_what_it_finished_marked_incomplete_and_appends_no_finding(
        tmp_path, monkeypatch):
    import json
    import re

    from typer.testing import CliRunner

    from kvq.cli import app

    finished = {"rows": [{"prompt": 8, "batch": 1, "cache": "a", "precision": "fp16", "ms_per_token": 4.0}]}

    def interrupted_after_one_prompt(*args, on_rows, **kwargs):
        on_rows(finished)
        raise KeyboardInterrupt

    monkeypatch.setattr(decode, "bench_decode", interrupted_after_one_prompt)
    done = CliRunner().invoke(app, ["bench", "decode", "--device", "cpu", "--out", str(tmp_path / "bench"),
                                    "--results", str(tmp_path / "RESULTS.md")])
    assert done.exit_code != 0
    [path] = (tmp_path / "bench").glob("decode-*.json")
    record = json.loads(path.read_text())
    assert record["complete"] is False and record["result"] == finished and record["bench"] == "decode"
    assert not (tmp_path / "RESULTS.md").exists()
    # where it kept them, after the seconds since the bench began
    assert re.search(rf"^kvq bench decode \[\d+ s\]: rows so far in {re.escape(str(path))}$", done.stderr, re.M)


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


@pytest.mark.parametrize("spec", [None, ("srft", 4, "per_group", 32)], ids=["fp16", "kvq-int4"])
def test_a_warm_up_on_one_prefill_chunk_compiles_every_graph_the_whole_prompt_runs(spec):
    import torch
    from torch._dynamo.utils import counters
    from transformers import DynamicCache, LlamaForCausalLM

    from kvq.generate import decode_routing, generate, static_cache
    from kvq.quant import QuantSpec

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=256)
    model = LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, config.vocab_size, (1, 40))
    spec = spec and QuantSpec(*spec)

    def run(ids: torch.Tensor, kwargs: dict) -> None:
        with torch.no_grad(), decode_routing(model, kwargs["past_key_values"], None):
            generate(model, ids, kwargs["past_key_values"], 6, prefill_chunk=16, compiled=True)

    warm = {"past_key_values": static_cache(model, spec, 1, 48, 16)}
    assert torch.equal(decode.warmup_prompt(prompt, 16, warm), prompt[:, :16])
    run(decode.warmup_prompt(prompt, 16, warm), warm)
    graphs = counters["stats"]["unique_graphs"]
    run(prompt, {"past_key_values": static_cache(model, spec, 1, 48, 16)})
    assert counters["stats"]["unique_graphs"] == graphs
    # a cache that grows with the prompt, one generate builds for it, or an unchunked prefill: the whole prompt
    for kwargs, chunk in (({"past_key_values": DynamicCache(config=config)}, 16),
                          ({"cache_implementation": "static"}, 16), (warm, None)):
        assert decode.warmup_prompt(prompt, chunk, kwargs) is prompt


def test_unknown_decode_cache_is_an_error_naming_it():
    with pytest.raises(Exception, match="unknown decode cache 'fp8'"):
        decode.decode_caches(("kvq-int4", "fp8"))


def test_the_memory_search_finds_the_largest_fitting_multiple():
    from kvq.bench.memory import largest

    assert largest(lambda n: 10 * n if n <= 13 else None, 1, 1) == (13, 130)
    assert largest(lambda n: n if n <= 40000 else None, 8192, 8192) == (32768, 32768)
    assert largest(lambda n: None, 8192, 8192) == (0, None)


def test_every_memory_cache_decodes_and_fp16_in_kvqs_layers_gives_the_static_caches_tokens():
    """Each cache `kvq bench memory` probes builds and decodes (on a tiny Llama, on CPU); `fp16-kvq`, every layer
    exact in kvq's static cache, holds what transformers' StaticCache holds and decodes its greedy tokens."""
    from transformers import LlamaForCausalLM

    from kvq.bench.memory import MEMORY_CACHES
    from kvq.generate import decode_routing, generate, static_cache
    from kvq.policy import parse_policy

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=101,
                                         initializer_range=0.2)).eval()
    prompt = torch.randint(1, 101, (2, 40), generator=torch.Generator().manual_seed(1))
    tokens, held = {}, {}
    for name, (spec, policy, window) in MEMORY_CACHES.items():
        cache = static_cache(model, spec, 2, 48, window, policy=parse_policy(policy))
        with torch.no_grad(), decode_routing(model, cache):
            tokens[name] = torch.stack(generate(model, prompt, cache, 8))
        held[name] = decode.cache_bytes(cache)
    assert torch.equal(tokens["fp16-kvq"], tokens["fp16"])
    assert held["fp16-kvq"] == held["fp16"]


def test_a_memory_table_names_the_device_it_emulates_and_the_one_it_ran_on():
    row = {"cache": "fp16", "context": 32768, "largest_batch": 15, "cache_bytes_at_batch": 15 << 32,
           "longest_context": 516096, "cache_bytes_at_context": 63 << 30}
    result = {"device_bytes": 85017493504, "emulated_on_bytes": None, "weight_bytes": 16 << 30, "prefill_chunk": 512,
              "decode_steps": 8, "rows": [row]}
    assert tables.memory_table(result).startswith("Device memory 79.2 GiB, weights 16.0 GiB;")
    emulated = tables.memory_table({**result, "emulated_on_bytes": 150 << 30})
    assert emulated.startswith("Device memory 79.2 GiB (emulated on a 150.0 GiB device: ")
    assert "| fp16 | 15 x 32768 | 60.0 | 516096 | 63.0 |" in emulated


@requires_cuda
@pytest.mark.gpu
def test_an_emulated_device_runs_out_of_memory_where_its_capacity_ends():
    """With the allocator capped for a device of half this one's bytes, an allocation that fits in them (less what
    the process holds outside the allocator) succeeds and one a tenth past them fails; after the block it fits."""
    from kvq.bench.memory import emulated_device

    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    room = total // 2 - (total - free - torch.cuda.memory_reserved())
    with emulated_device("cuda", total // 2):  # named as `kvq bench memory --device cuda` names it
        held = torch.empty(int(room * 0.9) - torch.cuda.memory_allocated(), dtype=torch.uint8, device="cuda")
        del held
        torch.cuda.empty_cache()
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(int(room * 1.1), dtype=torch.uint8, device="cuda")
    torch.cuda.empty_cache()
    torch.empty(int(room * 1.1), dtype=torch.uint8, device="cuda")  # the whole device again after the block


def test_the_cli_help_names_every_cache_a_bench_takes():
    import inspect

    from kvq import cli_bench
    from kvq.bench.memory import MEMORY_CACHES

    for command, names in ((cli_bench.bench_decode, [cache.name for cache in decode.DECODE_CACHES]),
                           (cli_bench.bench_memory, list(MEMORY_CACHES))):
        listed = inspect.signature(command).parameters["caches"].default.help
        listed = listed.split("subset of: ", 1)[1].split(" (default", 1)[0]
        assert [name.strip() for name in listed.split(",")] == names


def test_kernels_table_gives_each_quantize_row_and_its_torch_reference_their_x_floor():
    """A row moving 4.19 MB at a 4.19 TB/s copy rate has a 1 us floor: its kernel at 0.2 ns x 10000 vectors runs at
    2x it, its reference at 100 us at 100x it."""
    row = {"kernel": "k", "vectors": 10000, "d": 128, "bytes_moved": 4.19e6, "fused_ns_per_vector": 0.2,
           "fused_GBps": 2095.0, "fraction_of_peak_bandwidth": 0.5, "inverse_ns_per_vector": 0.1,
           "eager_call_us": 50.0, "reference_call_us": 100.0}
    text = tables.kernels_tables({"peak_bandwidth_Bps": 4.8e12, "copy_bandwidth_Bps": 4.19e12, "quantize": [row],
                                  "attention": []})
    assert "| k | 10000 x 128 | 0.20 | 2095.0 | 50.0% | 1.0 | 2.00 | 0.10 | 50.0 | 100.0 | 100.0 |" in text


def test_kernels_table_gives_each_attention_row_and_its_baselines_their_x_floor():
    """At a 4.194304 TB/s copy rate, 1024 tokens of 8 KV heads at d 128 in fp16 (4.19 MB) have a 1 us floor, so SDPA
    at 2 us runs at 2x it; the fused kernel read 1.05 MB of codes and scales (0.25 us) in 0.5 us, 2x its floor, and
    dequantize-then-SDPA, reading the same codes, at 2.5 us runs at 10x that floor."""
    row = {"context": 1024, "scales": "float16", "q_heads": 32, "kv_heads": 8, "d": 128, "fused_int4_us": 0.5,
           "fused_eager_call_us": 90.0, "sdpa_fp16_us": 2.0, "dequantize_then_sdpa_us": 2.5,
           "speedup_vs_sdpa_fp16": 4.0, "speedup_vs_dequantize_then_sdpa": 5.0, "fused_GBps": 2097.152}
    text = tables.kernels_tables({"peak_bandwidth_Bps": 4.8e12, "copy_bandwidth_Bps": 4.194304e12, "quantize": [],
                                  "attention": [row]})
    assert ("| 1024 | float16 | 0.5 | 0.25 | 2.00 | 2.0 | 1.00 | 2.00 | 2.5 | 10.00 | 4.00x | 5.00x | 2097.2 | 90.0 |"
            in text)
