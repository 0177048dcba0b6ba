"""The Markdown tables `kvq bench` prints and appends to RESULTS.md."""

from kvq.bench.timing import LAYERS
from kvq.ledger import markdown_table


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def quantize_floor_us(row: dict, copy_bandwidth: float) -> float:
    """A quantize call's floor: the bytes it moves at the measured device copy rate."""
    return row["bytes_moved"] / copy_bandwidth * 1e6


def attention_floors_us(row: dict, copy_bandwidth: float) -> tuple[float, float]:
    """An attention row's floors: the packed K/V it reads (the fused kernel's and dequantize-then-SDPA's) and the
    fp16 K/V SDPA reads, each at the measured device copy rate."""
    packed = row["fused_GBps"] * 1e9 * row["fused_int4_us"] / 1e6
    fp16 = 2 * row["kv_heads"] * row["context"] * row["d"] * 2
    return packed / copy_bandwidth * 1e6, fp16 / copy_bandwidth * 1e6


def _quantize_row(r: dict, copy: float) -> list[str]:
    floor = quantize_floor_us(r, copy)
    return [r["kernel"], f"{r['vectors']} x {r['d']}", _fmt(r["fused_ns_per_vector"], 2), _fmt(r["fused_GBps"]),
            _fmt(100 * r["fraction_of_peak_bandwidth"] if r["fraction_of_peak_bandwidth"] else None) + "%",
            _fmt(floor), _fmt(r["fused_ns_per_vector"] * r["vectors"] / 1e3 / floor, 2),
            _fmt(r["inverse_ns_per_vector"], 2), _fmt(r["eager_call_us"]), _fmt(r["reference_call_us"]),
            _fmt(r["reference_call_us"] / floor)]


def _attention_row(r: dict, copy: float) -> list[str]:
    packed_floor, fp16_floor = attention_floors_us(r, copy)
    return [str(r["context"]), r["scales"], _fmt(r["fused_int4_us"]), _fmt(packed_floor, 2),
            _fmt(r["fused_int4_us"] / packed_floor, 2), _fmt(r["sdpa_fp16_us"]), _fmt(fp16_floor, 2),
            _fmt(r["sdpa_fp16_us"] / fp16_floor, 2), _fmt(r["dequantize_then_sdpa_us"]),
            _fmt(r["dequantize_then_sdpa_us"] / packed_floor, 2), _fmt(r["speedup_vs_sdpa_fp16"], 2) + "x",
            _fmt(r["speedup_vs_dequantize_then_sdpa"], 2) + "x", _fmt(r["fused_GBps"]), _fmt(r["fused_eager_call_us"])]


def kernels_tables(result: dict) -> str:
    peak, copy = result["peak_bandwidth_Bps"], result["copy_bandwidth_Bps"]
    quantize = markdown_table(
        ["kernel", "vectors x d", "ns/vec", "GB/s", "of peak BW", "floor us", "x floor", "inverse ns/vec",
         "eager call us", "torch reference us", "reference x floor"],
        [_quantize_row(r, copy) for r in result["quantize"]])
    attention = markdown_table(
        ["context", "scales", "fused int4 us", "int4 floor us", "x floor", "SDPA fp16 us", "fp16 floor us",
         "SDPA x floor", "dequant+SDPA us", "dequant+SDPA x int4 floor", "vs SDPA fp16", "vs dequant+SDPA",
         "fused GB/s", "fused eager call us"],
        [_attention_row(r, copy) for r in result["attention"]])
    bandwidth = (f"Datasheet HBM bandwidth {_fmt(peak / 1e12 if peak else None, 2)} TB/s; a device-to-device copy "
                 f"measured {copy / 1e12:.2f} TB/s (read + write).")
    timing = ("Kernel columns are CUDA-graph replays (GPU time, no Python launch cost); an attention step is "
              f"the mean over {LAYERS} distinct layers' caches replayed back to back, as decode reads them, so "
              "L2 cannot serve a cache from the previous call. 'eager call' columns time the Python call as a "
              "user makes it. A quantize row's floor is the bytes it moves (fp16 rows in, codes and stats out) at "
              "the measured copy rate; the torch reference is the quantizer's own encode, which kvq runs where no "
              "kernel serves. An attention row's floors are the K/V bytes it reads at that rate: the packed codes "
              "and scales for the fused kernel and for dequantize-then-SDPA, fp16 K/V for SDPA.")
    return "\n\n".join([bandwidth, timing, "Fused quantize (fp16 input):", quantize,
                        "Decode attention, 32 query / 8 KV heads, d=128, int4 g32 (one step):", attention])


def decode_table(result: dict) -> str:
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


def memory_table(result: dict) -> str:
    """Largest batch at the context, longest context at one row, per cache, with the K/V each holds there."""
    gib = 2 ** 30
    header = ["cache", "largest batch at context", "its K/V GiB", "longest context at batch 1", "its K/V GiB"]
    rows = [[r["cache"], f"{r['largest_batch']} x {r['context']}", _fmt((r["cache_bytes_at_batch"] or 0) / gib),
             str(r["longest_context"]), _fmt((r["cache_bytes_at_context"] or 0) / gib)] for r in result["rows"]]
    emulated = result.get("emulated_on_bytes")
    on = (f" (emulated on a {emulated / gib:.1f} GiB device: PyTorch's allocator capped so that it and the process's "
          "memory outside it fit)" if emulated else "")
    return (f"Device memory {result['device_bytes'] / gib:.1f} GiB{on}, "
            f"weights {result['weight_bytes'] / gib:.1f} GiB; "
            f"a setting fits when its static cache, a {result['prefill_chunk']}-token prefill chunk and "
            f"{result['decode_steps']} decode steps run without running out of memory.\n\n"
            + markdown_table(header, rows))
