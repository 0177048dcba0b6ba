"""Host (Python + launch) microseconds per call of each piece of one decode step of one layer.

    python benchmarks/decode_overhead.py --context 8192

HF generate at Llama-3-8B size is host-bound on a fast GPU, so these costs, times 32 layers, decide
whether the fused int4 cache beats an fp16 DynamicCache per token. Calls are not synchronized: the
numbers are what the CPU spends issuing work.
"""

import argparse
import time

import torch
from transformers import DynamicCache, LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvq.apply import QuantizerBank, kv_geometry
from kvq.cache import QuantizedKVCache
from kvq.kernels import decode_attention
from kvq.kernels.decode_attention import DecodeGraph


def host_us(fn, calls: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    spent = time.perf_counter() - began
    torch.cuda.synchronize()
    return spent / calls * 1e6


def fused_step(layer, token, query) -> None:
    """One decode step of a fused layer, its window filling as in generate (the window count steps by one,
    which the decode graph follows on the device) but never flushing."""
    if layer.count >= layer.window - 2:
        layer.count = 0
    layer.update(*token)
    layer.attend(query, query.shape[-1] ** -0.5)


class _Attention(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 4
    training = False


def main() -> None:
    from kvq.quant import QuantSpec

    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=8192)
    args = parser.parse_args()
    config = LlamaConfig(num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
                         head_dim=128)
    bank = QuantizerBank(QuantSpec("srft", 4, "per_group", 32), kv_geometry(config))
    fused = QuantizedKVCache(bank, config, fused=True)
    dynamic = DynamicCache(config=config)
    prompt = [torch.randn(1, 8, args.context, 128, device="cuda", dtype=torch.float16) for _ in range(2)]
    fused.update(*prompt, 0)
    dynamic.update(*prompt, 0)
    layer = fused.layers[0]
    token = [torch.randn(1, 8, 1, 128, device="cuda", dtype=torch.float16) for _ in range(2)]
    query = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.float16)
    keys, values = layer.stores["k"].view(), layer.stores["v"].view()
    window = layer.raw["k"][..., :3, :]
    module = _Attention()
    pieces = {
        "fp16 DynamicLayer.update (cat)": lambda: dynamic.layers[0].update(*token),
        "fp16 sdpa_attention_forward": lambda: sdpa_attention_forward(module, query, dynamic.layers[0].keys,
                                                                       dynamic.layers[0].values, None),
        "kvq FusedLayer.update + attend (graph replay)": lambda: fused_step(layer, token, query),
        "kvq FusedLayer.update (flush, 1 in 16 steps)": lambda: (setattr(layer, "count", 15), layer.update(*token)),
        "kvq FusedLayer.attend (capture: 1st step, growth)": lambda: (setattr(layer, "decode_graph", DecodeGraph()),
                                                                    layer.attend(query, 128 ** -0.5)),
        "  decode_attention eager (3 launches)": lambda: decode_attention.decode_attention(
            query.squeeze(-2), layer.maps.query, keys, values, window, window, layer.maps.output, 128 ** -0.5),
    }
    for name, fn in pieces.items():
        print(f"{name:42s} {host_us(fn):8.1f} us")


if __name__ == "__main__":
    main()
