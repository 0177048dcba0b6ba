"""Where a model's keys keep their energy, and what each quantizer does to it: per layer, the share of
|k|^2 in the per-channel mean over tokens (an offset such as Qwen2's k_proj bias) and in each key's
largest channel, and each quantizer's relative error on the whole key and on that largest channel.

    python benchmarks/key_channels.py --model qwen2.5-coder-0.5b --quant turbo:4 --quant int:4 --quant kivi:4

Keys are captured post-RoPE (cache mode) from 2 x 512 tokens of the calibration split of Shakespeare.
"""

import argparse

from kvq import models
from kvq.capture import capture_kv
from kvq.data import token_windows
from kvq.quant import Site, build_quantizer
from kvq.quant.spec import parse_spec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--quant", action="append", default=None, help="as kvq ppl --quant; repeatable")
    args = parser.parse_args()
    specs = [parse_spec(text) for text in args.quant or ["turbo:4", "int:4", "kivi:4"]]
    lm = models.load(args.model)
    windows = token_windows(lm.tokenizer, "shakespeare", 512, 2, split="calib")
    for (layer, role), keys in sorted(capture_kv(lm.model, windows, "cache", 4096).items()):
        if role != "k":
            continue
        energy = keys.pow(2).sum(1)
        offset = float(keys.mean(0).pow(2).sum() / energy.mean())
        top = keys.abs().argmax(1, keepdim=True)
        top_share = float((keys.gather(1, top).squeeze(1) ** 2 / energy).mean())
        line = [f"layer {layer:2d}: offset {offset:.3f}, largest channel {top_share:.3f} of |k|^2"]
        for spec in specs:
            quantizer = build_quantizer(spec, Site(layer, "k", keys.shape[1]))
            error = quantizer(keys.view(1, 1, *keys.shape)).view_as(keys) - keys
            whole = float((error.pow(2).sum(1) / energy).mean())
            on_top = float((error.gather(1, top).squeeze(1) ** 2 / energy).mean())
            line.append(f"{spec.label()} error {whole:.4f} (largest channel {on_top:.6f})")
        print("; ".join(line))


if __name__ == "__main__":
    main()
