"""Where a compiled decode step's time goes: GPU kernel time per step against the step's length on the GPU
timeline, on `kvq bench decode`'s model, for its compiled rows.

    python benchmarks/decode_profile.py [--prompt 32768] [--batch 1] [--new-tokens 16] [--prefill-chunk 4096]
                                        [--caches a,b] [--top 12]

A generate row runs one untimed generate (compilation), then two generates under torch.profiler, of 4 and of
4 + new-tokens tokens: their difference is new-tokens decode steps, the prefill cancelling up to its own
run-to-run variation. A step-loop row (`kvq.generate.generate`) runs once untimed, then again with the
profiler started after its prefill and first steps (the GPU drained first), so its kernels are decode steps
only. Busy is the time per step at least one GPU kernel runs; a step longer than its busy time waited on the host
or on gaps between kernels. The kernels' durations sum to more than busy where they overlap: a kernel launched
early (programmatic dependent launch) counts its wait for the one before. The top kernels say which of them fill
the busy time, and the count of kernels a step runs says how much of it is launches of small ones.

For a row with kvq's decode kernels, each layer's write, partial and reduce are also placed on the timeline: how
long the write runs, how far into it the partial starts, how long the partial runs past the write's end, and how
long the reduce ends after the partial: the last is the latency the split-K reduce adds to a layer.
"""

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from kvq.bench.decode import DECODE_CACHES, StepClock, decode_model, decode_run, llama3_8b_like, warm_up
from kvq.generate import decode_routing, generate

WARM_STEPS = 4


def kernel_times(trace) -> tuple[collections.Counter, int, float]:
    """Microseconds per kernel name over the profiled region (device-side events only), how many kernels ran (a
    latency-bound kernel costs its launch whatever bytes it moves), and the microseconds at least one ran: a kernel
    launched early under programmatic dependent launch waits inside its own duration, so durations overlap and
    their sum overstates the busy time."""
    times, launches, spans = collections.Counter(), 0, []
    for event in trace.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] += event.device_time
            launches += 1
            spans.append((event.time_range.start, event.time_range.end))
    busy, reached = 0.0, float("-inf")
    for start, end in sorted(spans):
        busy += max(0.0, end - max(start, reached))
        reached = max(reached, end)
    return times, launches, busy


LAYER_KERNELS = ("kvq_write_rows", "kvq_decode_partial", "kvq_decode_reduce")


def attention_spans(trace) -> dict[str, float] | None:
    """Mean microseconds per layer between kvq's decode kernels on the timeline (None without them). A layer is its
    writes (one or one per role), then its partial, then its reduce, in start order."""
    events = sorted((event.time_range.start, event.time_range.end, kind) for event in trace.events()
                    if event.device_type == torch.autograd.DeviceType.CUDA
                    for kind in LAYER_KERNELS if kind in event.name)
    layers, writes, partial = [], [], None
    for start, end, kind in events:
        if kind == LAYER_KERNELS[0]:
            writes.append((start, end))
        elif kind == LAYER_KERNELS[1]:
            partial = (start, end)
        elif writes and partial is not None:
            first_write, last_write_end = writes[0][0], max(end for _, end in writes)
            layers.append({"write": last_write_end - first_write,
                           "partial starts into the write": partial[0] - first_write,
                           "partial runs past the write": partial[1] - last_write_end,
                           "reduce ends after the partial": end - partial[1],
                           "write start to reduce end": end - first_write})
            writes, partial = [], None
    if not layers:
        return None
    return {name: sum(layer[name] for layer in layers) / len(layers) for name in layers[0]}


def generate_profile(model, cache, prompt, new_tokens: int, max_tokens: int,
                     prefill_chunk: int | None) -> tuple[float, dict, float, float, None]:
    profiles, runs = [], []
    for tokens in (WARM_STEPS, new_tokens + WARM_STEPS):
        with profile(activities=[ProfilerActivity.CUDA]) as trace:
            runs.append(decode_run(model, cache, cache.setup(model, prompt.shape[0], max_tokens), prompt, tokens,
                                   prefill_chunk))
        profiles.append(kernel_times(trace))
    (short_times, short_launches, short_busy), (long_times, long_launches, long_busy) = profiles
    steps = runs[1].steps_s[WARM_STEPS:]
    per_step = {name: (us - short_times[name]) / new_tokens for name, us in long_times.items()}
    return (sum(steps) / len(steps), per_step, (long_launches - short_launches) / new_tokens,
            (long_busy - short_busy) / new_tokens, None)


def step_loop_profile(model, cache, prompt, new_tokens: int, max_tokens: int,
                      prefill_chunk: int | None) -> tuple[float, dict, float, float, dict | None]:
    kv = cache.setup(model, prompt.shape[0], max_tokens)["past_key_values"]
    trace = profile(activities=[ProfilerActivity.CUDA])
    clock = StepClock(prompt.device)

    def on_token(_):
        if len(clock.marks) == WARM_STEPS:
            torch.cuda.synchronize()
            trace.start()
        clock.tick()

    with torch.no_grad(), decode_routing(model, kv, cache.attention):
        generate(model, prompt, kv, WARM_STEPS + new_tokens + 1, prefill_chunk=prefill_chunk, on_token=on_token,
                 compiled=True, tuned_gemv=cache.tuned_gemv)
    torch.cuda.synchronize()
    trace.stop()
    steps = clock.seconds()[1][WARM_STEPS:]
    times, launches, busy = kernel_times(trace)
    return (sum(steps) / len(steps), {name: us / len(steps) for name, us in times.items()}, launches / len(steps),
            busy / len(steps), attention_spans(trace))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prefill-chunk", type=int, default=0, help="prefill chunk in tokens; 0: one pass")
    parser.add_argument("--caches", default="fp16-gqa-static-step,kvq-int4-static-step")
    parser.add_argument("--top", type=int, default=12, help="how many of the longest kernels to list per row")
    args = parser.parse_args()
    model = decode_model("cuda", llama3_8b_like())
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt), device="cuda")
    max_tokens = args.prompt + args.new_tokens + WARM_STEPS + 1
    chosen = [cache for cache in DECODE_CACHES if cache.name in args.caches.split(",")]
    chunk = args.prefill_chunk or None
    for cache in chosen:
        warm_up(model, cache, prompt, max_tokens, args.new_tokens + WARM_STEPS, chunk)
        measure = step_loop_profile if cache.loop == "step" else generate_profile
        step_s, per_step, launches, busy_us, spans = measure(model, cache, prompt, args.new_tokens, max_tokens, chunk)
        print(f"\n{cache.label}: {1e3 * step_s:.2f} ms/step on the GPU timeline, {busy_us / 1e3:.2f} ms of it with "
              f"a kernel running; {launches:.0f} kernels, their durations summing to "
              f"{sum(per_step.values()) / 1e3:.2f} ms")
        for name, us in sorted(per_step.items(), key=lambda item: -item[1])[:args.top]:
            print(f"  {us / 1e3:7.3f} ms/step  {name[:110]}")
        if spans:
            print("  per layer: " + ", ".join(f"{name} {us:.2f} us" for name, us in spans.items()))


if __name__ == "__main__":
    main()
