"""Where a decode step's time goes per layout: the write (the rows one step quantizes: a token, or KIVI's 32-row key
group) and the fused attention over 32K packed tokens, at Llama-3-8B's heads (32 query, 8 KV, d 128), batch 1 unless
named.

    python benchmarks/decode_cost_split.py [--batch 8] [--layouts int4-srft-g32,kivi4,k8v4]

Each is timed as CUDA-graph replays of one call per layer over 32 distinct layers' caches and written rows
(kvq.bench.timing.time_per_layer), so no layer's packed bytes are still in L2 when it is read again; the mean per
layer times 32 is the milliseconds per step.
"""
import argparse
import dataclasses

import torch

from kvq import ops
from kvq.apply import KVGeometry, QuantizerBank
from kvq.bench.decode import K8_V4
from kvq.bench.timing import time_per_layer
from kvq.cache import DomainMaps
from kvq.policy import parse_policy
from kvq.quant import QuantSpec

T, HKV, HQ, D, LAYERS = 32768, 8, 32, 128, 32
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


def measure(name: str, spec: QuantSpec, batch: int, generator: torch.Generator) -> None:
    bank = QuantizerBank(spec, KVGeometry(1, HKV, D), policy=parse_policy(POLICIES.get(name)))
    forms, states, writes = {}, {}, {}
    for role in ("k", "v"):
        rows = torch.randn(batch, HKV, T, D, device="cuda", generator=generator, dtype=torch.float16)
        form = forms[role] = bank.get(0, role).calibrated_form(rows)  # a layer scale, where the format has one
        states[role] = ops.PackedKV.holding(*ops.quantize(rows, form), form)
        writes[role] = rows[:, :, :form.layout.token_group].contiguous()
    window = torch.randn(2, batch, HKV, 16, D, device="cuda", dtype=torch.float16)
    maps = DomainMaps(forms["k"], forms["v"], torch.device("cuda"))
    layers = [(maps.step(*(dataclasses.replace(states[r], codes=states[r].codes.clone(),
                                               scales=states[r].scales.clone()) for r in ("k", "v")),
                         (window[0], window[1])), {r: writes[r].clone() for r in ("k", "v")})
              for _ in range(LAYERS)]
    query = torch.randn(batch, HQ, D, device="cuda", dtype=torch.float16)
    write = time_per_layer(lambda _, rows: [ops.quantize(rows[r], forms[r]) for r in ("k", "v")], layers, "cuda")
    attend = time_per_layer(lambda step, _: ops.decode_attention(query, step, D ** -0.5), layers, "cuda")
    print(f"{name:16s} batch {batch} write x{LAYERS} {write * LAYERS * 1e3:7.3f} ms  "
          f"attend x{LAYERS} {attend * LAYERS * 1e3:7.3f} ms  "
          f"(K {forms['k'].layout.bits}b, token_group {forms['k'].layout.token_group})", flush=True)


parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--batch", type=int, default=1)
parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"a comma-separated subset of {', '.join(LAYOUTS)}")
args = parser.parse_args()
generator = torch.Generator(device="cuda").manual_seed(0)
for name in args.layouts.split(","):
    measure(name, LAYOUTS[name], args.batch, generator)
