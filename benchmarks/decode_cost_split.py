"""Where a decode step's time goes per layout: the write (the rows one step quantizes: a token, or KIVI's 32-row key
group) and the fused attention over the packed tokens, at Llama-3-8B's heads (32 query, 8 KV, d 128), batch 1 unless
named, beside the fair fp16 cache's write and attention (index_copy_ into a static buffer, SDPA with enable_gqa).

    python benchmarks/decode_cost_split.py [--batch 8] [--tokens 4096,32768] [--layouts int4-srft-g32,kivi4,k8v4]

The write goes through what the static cache runs: kvq.ops.write_rows, K and V in one call where the cache writes them
so (StaticQuantizedLayer.row_writes), and kvq.ops.quantize for a role whose stats span token groups. Each is timed as
CUDA-graph replays of one call per layer over 32 distinct layers' caches and written rows
(kvq.bench.timing.time_per_layer), so no layer's bytes are still in L2 when it is read again; the mean per layer
times 32 is the milliseconds per step. As in the static cache, a step attends over the packed rows before the one
it writes (their count on the device) and over the exact window. The attention's floor is the K/V bytes it reads at
the measured copy rate, so that across --tokens the fixed cost of a call (what the time keeps as the bytes go to zero)
shows beside the streaming. A third time is the write, then the attention, in a step's order: on CUDA the attention's
packed programs stream beside the write, and what that saves shows against the two alone.
"""
import argparse
import dataclasses

import torch
import torch.nn.functional as F

from kvq import ops
from kvq.apply import KVGeometry, QuantizerBank
from kvq.bench.decode import K8_V4
from kvq.bench.timing import copy_bandwidth, time_per_layer
from kvq.cache import DomainMaps
from kvq.policy import parse_policy
from kvq.quant import QuantSpec
from kvq.static_cache import StaticQuantizedLayer

HKV, HQ, D, LAYERS, WINDOW = 8, 32, 128, 32, 32  # a window that holds a KIVI key group
INT4_G32 = QuantSpec("srft", 4, "per_group", 32)  # kvq bench decode's int4, and the base its K8/V4 policy raises
LAYOUTS = {"int4-srft-g32": INT4_G32,
           "int4-asym-g32": QuantSpec("srft", 4, "per_group", 32, symmetric=False, scale_dtype="float16"),
           "kivi4": QuantSpec("kivi", 4, group_size=32), "kivi2": QuantSpec("kivi", 2, group_size=32),
           "turbo4": QuantSpec("turbo", 4), "turbo3": QuantSpec("turbo", 3), "mxfp4": QuantSpec("mx"),
           "int3-srft-g32": QuantSpec("srft", 3, "per_group", 32),
           "nvfp4": QuantSpec("nvfp4"), "fp8-token": QuantSpec("fp8", options={"scale": "token"}),
           "fp8-tensor": QuantSpec("fp8", options={"scale": "tensor"}),
           "k8v4": INT4_G32}
POLICIES = {"k8v4": K8_V4}  # a layout whose K and V differ: kvq bench decode's policy for its cache


def measure(name: str, spec: QuantSpec, tokens: int, batch: int, bandwidth: float,
            generator: torch.Generator) -> None:
    bank = QuantizerBank(spec, KVGeometry(1, HKV, D), policy=parse_policy(POLICIES.get(name)))
    row_writes = StaticQuantizedLayer(bank, 0, tokens, WINDOW).row_writes
    forms, states, writes = {}, {}, {}
    for role in ("k", "v"):
        rows = torch.randn(batch, HKV, tokens, D, device="cuda", generator=generator, dtype=torch.float16)
        form = forms[role] = bank.get(0, role).calibrated_form(rows)  # a layer scale, where the format has one
        states[role] = ops.PackedKV.holding(*ops.quantize(rows, form), form)
        writes[role] = rows[:, :, :form.layout.token_group].contiguous()
        del rows
    kv_bytes = sum(t.numel() * t.element_size() for p in states.values() for t in (p.codes, p.scales))
    window = torch.randn(2, batch, HKV, WINDOW, D, device="cuda", dtype=torch.float16)
    maps = DomainMaps(forms["k"], forms["v"], torch.device("cuda"))
    layers = [(maps.step(*(dataclasses.replace(states[r], codes=states[r].codes.clone(),
                                               scales=states[r].scales.clone()) for r in ("k", "v")),
                         (window[0].clone(), window[1].clone())), {r: writes[r].clone() for r in ("k", "v")})
              for _ in range(LAYERS)]
    del states
    # as in the static cache: a step attends over the packed rows before the one it writes, and the window's
    attended = tokens - 2 * WINDOW
    length = torch.tensor(attended, device="cuda")
    counts = torch.tensor([ops.device_lengths(attended, WINDOW)], device="cuda")
    query = torch.randn(batch, HQ, D, device="cuda", dtype=torch.float16)

    def write(step: ops.DecodeStep, rows: dict) -> None:
        packed = {"k": step.keys, "v": step.values}
        ring = dict(zip(("k", "v"), step.window, strict=True))
        for role in (r for r in ("k", "v") if forms[r].layout.token_group > 1):  # as the cache's _write_groups
            ops.quantize(rows[role], forms[role])
        for roles in row_writes:
            ops.write_rows([rows[r] for r in roles], [forms[r] for r in roles], [packed[r].codes for r in roles],
                           [packed[r].scales for r in roles], [ring[r] for r in roles], length, query)

    def attend(step: ops.DecodeStep, _) -> torch.Tensor:
        return ops.decode_attention(query, step, D ** -0.5, counts)

    def write_then_attend(step: ops.DecodeStep, rows: dict) -> torch.Tensor:
        write(step, rows)
        return attend(step, rows)

    _report(name, batch, tokens, *(time_per_layer(f, layers, "cuda") for f in (write, attend, write_then_attend)),
            kv_bytes * attended / tokens / bandwidth,
            f"K {forms['k'].layout.bits}b, token_group {forms['k'].layout.token_group}")


def measure_fp16(tokens: int, batch: int, bandwidth: float, generator: torch.Generator) -> None:
    """The fair fp16 row's share: its static buffers' index_copy_ of a step's K and V, and SDPA reading each KV head
    once (enable_gqa)."""
    layers = [([torch.randn(batch, HKV, tokens, D, device="cuda", generator=generator, dtype=torch.float16)
                for _ in range(2)],
               [torch.randn(batch, HKV, 1, D, device="cuda", generator=generator, dtype=torch.float16)
                for _ in range(2)]) for _ in range(LAYERS)]
    position = torch.tensor([tokens - 1], device="cuda")
    query = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.float16)

    def write(kv: list, rows: list) -> None:
        for buffer, row in zip(kv, rows, strict=True):
            buffer.index_copy_(2, position, row)

    def attend(kv: list, _) -> torch.Tensor:
        return F.scaled_dot_product_attention(query, *kv, enable_gqa=True)

    def write_then_attend(kv: list, rows: list) -> torch.Tensor:
        write(kv, rows)
        return attend(kv, rows)

    _report("fp16", batch, tokens, *(time_per_layer(f, layers, "cuda") for f in (write, attend, write_then_attend)),
            2 * batch * HKV * tokens * D * 2 / bandwidth, "static, SDPA")


def _report(name: str, batch: int, tokens: int, write: float, attend: float, both: float, floor: float,
            what: str) -> None:
    """Per step of LAYERS layers; `both`: the write, then the attention, as a step runs them (on CUDA the kvq
    attention's packed programs stream beside the write: what `both` saves against write + attend)."""
    print(f"{name:16s} batch {batch} tokens {tokens:>6}  write x{LAYERS} {write * LAYERS * 1e3:7.3f} ms  "
          f"attend x{LAYERS} {attend * LAYERS * 1e3:7.3f} ms, {attend / floor:5.2f}x its K/V floor "
          f"({attend * 1e6:7.2f} against {floor * 1e6:7.2f} us a layer)  write, then attend x{LAYERS} "
          f"{both * LAYERS * 1e3:7.3f} ms (saves {(write + attend - both) * LAYERS * 1e3:6.3f}; {what})", flush=True)


parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--batch", type=int, default=1)
parser.add_argument("--tokens", default="32768", help="comma-separated packed lengths")
parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"a comma-separated subset of {', '.join(LAYOUTS)}")
args = parser.parse_args()
generator = torch.Generator(device="cuda").manual_seed(0)
copy_rate = copy_bandwidth("cuda")
print(f"copy rate {copy_rate / 1e12:.2f} TB/s", flush=True)
for length in map(int, args.tokens.split(",")):
    measure_fp16(length, args.batch, copy_rate, generator)
    for name in args.layouts.split(","):
        measure(name, LAYOUTS[name], length, args.batch, copy_rate, generator)
