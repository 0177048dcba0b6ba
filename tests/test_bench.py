"""`kvq bench decode` end to end on a tiny random Llama (CPU: the fused cache takes the reference path)."""

from transformers import LlamaConfig

from kvq import bench


def test_bench_decode_times_each_step_of_each_cache():
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=256)
    result = bench.bench_decode("cpu", prompts=(40,), new_tokens=5, config=config, repeats=2)
    timed = {row["cache"]: row for row in result["rows"] if "skipped" not in row}
    assert {"fp16 DynamicCache", "kvq fused int4 g32"} <= set(timed)
    for row in timed.values():
        assert len(row["ms_per_token_runs"]) == 2
        assert min(row["ms_per_token_runs"]) <= row["ms_per_token"] <= max(row["ms_per_token_runs"])
        assert row["prefill_s"] > 0 and row["cache_bytes"] > 0 and row["ms_per_token_mean"] > 0
    ratios = [a / b for a, b in zip(timed["kvq fused int4 g32"]["ms_per_token_runs"],
                                    timed["fp16 DynamicCache"]["ms_per_token_runs"], strict=True)]
    assert timed["fp16 DynamicCache"]["paired_ratio_to_first"] == 1.0
    assert min(ratios) <= timed["kvq fused int4 g32"]["paired_ratio_to_first"] <= max(ratios)
