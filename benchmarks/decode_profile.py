"""Where a compiled decode step's time goes: GPU kernel time per step against the step's length on the GPU
timeline, for fp16 StaticCache + compile and kvq's static int4 cache, on `kvq bench decode`'s model.

    python benchmarks/decode_profile.py [--prompt 32768] [--batch 1] [--new-tokens 16]

Each cache runs one untimed generate (compilation), then two generates under torch.profiler, of 4 and of
4 + new-tokens tokens: their difference is new-tokens decode steps, the prefill cancelling. Busy is the sum of
the GPU kernels' durations per step; a step longer than its busy time waited on the host or on gaps between
kernels. The top kernels say which of them fill the busy time.
"""

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from kvq.bench import DECODE_CACHES, decode_model, generate_run, llama3_8b_like


def kernel_times(trace) -> collections.Counter:
    """Microseconds per kernel name over the profiled region (device-side events only)."""
    times = collections.Counter()
    for event in trace.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] += event.device_time
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--caches", default="fp16-static-compiled,kvq-int4-static-compiled")
    args = parser.parse_args()
    model = decode_model("cuda", llama3_8b_like())
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt), device="cuda")
    max_tokens = args.prompt + args.new_tokens + 4
    chosen = [cache for cache in DECODE_CACHES if cache.name in args.caches.split(",")]
    for cache in chosen:
        generate_run(model, cache.setup(model, args.batch, max_tokens), prompt, args.new_tokens + 4)
        times, runs = [], []
        for tokens in (4, args.new_tokens + 4):
            with profile(activities=[ProfilerActivity.CUDA]) as trace:
                runs.append(generate_run(model, cache.setup(model, args.batch, max_tokens), prompt, tokens))
            times.append(kernel_times(trace))
        per_step = {name: (us - times[0][name]) / args.new_tokens for name, us in times[1].items()}
        steps = runs[1].steps_s[4:]
        step_ms = 1e3 * sum(steps) / len(steps)
        busy_ms = sum(per_step.values()) / 1e3
        print(f"\n{cache.label}: {step_ms:.2f} ms/step on the GPU timeline, {busy_ms:.2f} ms of it in kernels")
        for name, us in sorted(per_step.items(), key=lambda item: -item[1])[:12]:
            print(f"  {us / 1e3:7.3f} ms/step  {name[:110]}")

if __name__ == "__main__":
    main()
