"""Where a decode step's time goes per layout: the write (the rows one step quantizes: a token, or KIVI's 32-row key
group) and the fused attention over 32K packed tokens, at Llama-3-8B's heads (32 query, 8 KV, d 128), batch 1.

    python benchmarks/decode_cost_split.py

Each is captured 32 times in one CUDA graph (as many as the model's layers) over one layer's cache and replayed;
milliseconds per replay are per step. One layer's cache serves all 32 calls, so the packed bytes a call reads
(42 MB for int4 g32) may partly stay in the H200's 50 MB L2: attention times are lower bounds, closer for the larger
layouts.
"""
import torch

from kvq import ops
from kvq.apply import KVGeometry, QuantizerBank
from kvq.cache import DomainMaps
from kvq.quant import QuantSpec

T, HKV, HQ, D, LAYERS = 32768, 8, 32, 128, 32
LAYOUTS = {"int4-srft-g32": QuantSpec("srft", 4, "per_group", 32), "kivi4": QuantSpec("kivi", 4, group_size=32),
           "turbo4": QuantSpec("turbo", 4), "mxfp4": QuantSpec("mx"),
           "fp8-token": QuantSpec("fp8", options={"scale": "token"})}


def graph_ms(fn):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        with torch.cuda.graph(graph):
            for _ in range(LAYERS):
                fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 10


def measure(name: str, spec: QuantSpec, generator: torch.Generator) -> None:
    bank = QuantizerBank(spec, KVGeometry(1, HKV, D))
    forms = {role: bank.get(0, role).packed_form() for role in ("k", "v")}
    states, writes = {}, {}
    for role in ("k", "v"):
        form = forms[role]
        rows = torch.randn(1, HKV, T, D, device="cuda", generator=generator, dtype=torch.float16)
        codes, stats = ops.quantize(rows, form)
        layout = form.layout
        states[role] = ops.PackedKV(codes, stats, layout.bits, D, layout.symmetric, layout.token_group,
                                    form.on(rows.device).codebook)
        writes[role] = rows[:, :, :layout.token_group].contiguous()
    window = torch.randn(2, 1, HKV, 16, D, device="cuda", dtype=torch.float16)
    step = DomainMaps(forms["k"], forms["v"], torch.device("cuda")).step(states["k"], states["v"],
                                                                            (window[0], window[1]))
    query = torch.randn(1, HQ, D, device="cuda", dtype=torch.float16)
    write = graph_ms(lambda: [ops.quantize(writes[r], forms[r]) for r in ("k", "v")])
    attend = graph_ms(lambda: ops.decode_attention(query, step, D ** -0.5))
    print(f"{name:16s} write x32 {write:7.3f} ms  attend x32 {attend:7.3f} ms  "
          f"(K {forms['k'].layout.bits}b, token_group {forms['k'].layout.token_group})", flush=True)


generator = torch.Generator(device="cuda").manual_seed(0)
for name, spec in LAYOUTS.items():
    measure(name, spec, generator)
