"""`kvq bench`: kernel and decode speed, recorded as JSON and a RESULTS.md finding."""

import sys
import time
from collections.abc import Callable
from pathlib import Path

import typer

from kvq.cli_common import device_option, floats
from kvq.errors import KvqError

bench_app = typer.Typer(no_args_is_help=True, help="Kernel and decode speed (JSON under runs/bench, RESULTS.md item).")


def _bench_record(kind: str, device: str, out: Path) -> tuple[dict, Path]:
    """A bench's provenance, taken as it starts, and the JSON path its rows go to."""
    from kvq.provenance import provenance

    record = {"bench": kind, **provenance(device)}
    return record, out / f"{kind}-{record['timestamp'][:19].replace(':', '')}.json"


def _progress(kind: str) -> Callable[[str], None]:
    """Prints a bench's progress lines on stderr, each after the seconds since the bench began, so a reader of a
    long run sees what each warm-up and timed run costs."""
    began = time.monotonic()
    return lambda line: typer.echo(f"kvq bench {kind} [{time.monotonic() - began:.0f} s]: {line}", err=True)


def _keep_partial(started: tuple[dict, Path], progress: Callable[[str], None]) -> Callable[[dict], None]:
    """What hears a bench's rows so far: an interrupted bench keeps the rows it finished, marked incomplete (no
    finding)."""
    from kvq.store import write_json_atomic

    record, path = started

    def keep(partial: dict) -> None:
        write_json_atomic(path, {**record, "result": partial, "complete": False})
        progress(f"rows so far in {path}")

    return keep


def _record_bench(kind: str, result: dict, table: str, device: str, out: Path, results: Path,
                  started: tuple[dict, Path] | None = None) -> None:
    """Writes the finished bench (over any partial record at the same path) and appends its RESULTS.md finding."""
    from kvq.ledger import append_finding
    from kvq.report import bench_finding
    from kvq.store import write_json_atomic

    record, path = started or _bench_record(kind, device, out)
    record = {**record, "result": result, "complete": True}
    write_json_atomic(path, record)
    typer.echo(table)
    finding = bench_finding(f"kvq {' '.join(sys.argv[1:])}", kind, record, table, path)
    number = append_finding(results, finding.title, finding.body).number
    typer.echo(f"wrote {path}; appended finding {number} to {results}")


@bench_app.command("kernels")
def bench_kernels(
    vectors: int = typer.Option(262144, help="vectors for the quantize kernel"),
    contexts: str = typer.Option("1024,8192,32768,131072", help="KV lengths for decode attention"),
    out: Path = typer.Option(Path("runs/bench")),
    results: Path = typer.Option(Path("RESULTS.md")),
    device: str = device_option(),
):
    """Fused quantize ns/vec, GB/s and fraction of HBM bandwidth; fused int4 decode attention vs SDPA."""
    from kvq.bench import kernels, tables

    result = kernels.bench_kernels(device, vectors, tuple(int(x) for x in floats(contexts)))
    _record_bench("kernels", result, tables.kernels_tables(result), device, out, results)


@bench_app.command("decode")
def bench_decode(
    prompts: str = typer.Option("8192,32768,131072", help="prompt lengths"),
    batches: str = typer.Option("1,8", help="batch sizes; a row that does not fit says so"),
    caches: str = typer.Option("", help="comma-separated subset of: fp16-dynamic, fp16-static-compiled, kvq-int4, "
                                        "quanto-int4, hqq-int4, fp16-static-step, kvq-int4-static-compiled, "
                                        "kvq-int4-static-step, kvq-int4-fp-boundary-static-compiled, "
                                        "kvq-int4-fp-boundary-static-step, kvq-k8v4-static-compiled, "
                                        "kvq-k8v4-static-step, kvq-int4-asym-static-compiled, "
                                        "kvq-int4-asym-static-step, kvq-kivi4-static-compiled, kvq-kivi4-static-step,"
                                        " kvq-kivi2-static-compiled, kvq-kivi2-static-step, "
                                        "kvq-turbo4-static-compiled, kvq-turbo4-static-step, "
                                        "kvq-turbo3-static-compiled, kvq-turbo3-static-step, "
                                        "kvq-mxfp4-static-compiled, kvq-mxfp4-static-step, kvq-nvfp4-static-compiled,"
                                        " kvq-nvfp4-static-step, kvq-fp8-static-compiled, kvq-fp8-static-step, "
                                        "kvq-fp8-tensor-static-compiled, kvq-fp8-tensor-static-step, "
                                        "fp16-gqa-static-compiled, fp16-gqa-static-step, "
                                        "fp16-gqa-static-step-tuned (default: all)"),
    new_tokens: int = typer.Option(32),
    repeats: int = typer.Option(9, help="timed generates per cache and prompt, the caches taking turns"),
    prefill_chunk: int = typer.Option(0, help="prefill every prompt in chunks of this many tokens "
                                             "(generate's prefill_chunk_size; 0: one pass)"),
    out: Path = typer.Option(Path("runs/bench")),
    results: Path = typer.Option(Path("RESULTS.md")),
    device: str = device_option(),
):
    """ms/token per cache (HF generate with fp16 eager and compiled, kvq int4, transformers' quantized caches; a
    compiled step loop over the static caches), with each row's bandwidth floor (Llama-3-8B shapes, random
    weights)."""
    from kvq.bench import decode, tables

    if new_tokens < 2:
        raise KvqError(f"--new-tokens must be at least 2 (ms/token is a difference), got {new_tokens}")
    if repeats < 1:
        raise KvqError(f"--repeats must be at least 1, got {repeats}")
    if prefill_chunk < 0:
        raise KvqError(f"--prefill-chunk must be 0 (one pass) or a positive number of tokens, got {prefill_chunk}")
    chosen = decode.decode_caches(tuple(caches.split(",")) if caches else None)
    lengths, sizes = (tuple(int(x) for x in floats(text)) for text in (prompts, batches))
    if min(lengths) < 1 or min(sizes) < 1:
        raise KvqError(f"--prompts and --batches must be positive, got {prompts!r} and {batches!r}")
    started, progress = _bench_record("decode", device, out), _progress("decode")
    result = decode.bench_decode(device, lengths, new_tokens, repeats=repeats, batches=sizes, caches=chosen,
                                prefill_chunk=prefill_chunk or None, on_rows=_keep_partial(started, progress),
                                progress=progress)
    _record_bench("decode", result, tables.decode_table(result), device, out, results, started)


@bench_app.command("memory")
def bench_memory(
    context: int = typer.Option(32768, min=64, help="the context of the largest-batch search, in tokens"),
    caches: str = typer.Option("fp16,fp16-kvq,kvq-int4", help="comma-separated subset of: fp16, fp16-kvq, kvq-int4, "
                                                             "kvq-int4-fp-boundary, kvq-k8v4, kvq-kivi4, kvq-kivi2, "
                                                             "kvq-turbo4, kvq-turbo3, kvq-mxfp4, kvq-nvfp4, kvq-fp8, "
                                                             "kvq-fp8-tensor"),
    prefill_chunk: int = typer.Option(4096, min=1, help="tokens of the prefill chunk each probe runs"),
    device_memory: int = typer.Option(None, min=1, help="bytes of a smaller device of the same kind to emulate (its "
                                                        "torch total_memory; an 80 GB H100's is 85017493504)"),
    out: Path = typer.Option(Path("runs/bench")),
    results: Path = typer.Option(Path("RESULTS.md")),
    device: str = device_option(),
):
    """The largest batch at a context and the longest context at batch 1 that fit, per static cache (Llama-3-8B
    shapes, random weights; CUDA only), on the device or on a smaller one it emulates."""
    from kvq.bench import memory, tables

    if not device.startswith("cuda"):
        raise KvqError(f"kvq bench memory measures a CUDA device's memory; --device is {device}")
    chosen = tuple(caches.split(","))
    unknown = [name for name in chosen if name not in memory.MEMORY_CACHES]
    if unknown:
        raise KvqError(f"--caches: unknown cache {unknown[0]!r}; known: {', '.join(memory.MEMORY_CACHES)}")
    started, progress = _bench_record("memory", device, out), _progress("memory")
    result = memory.bench_memory(device, context, chosen, prefill_chunk, device_memory,
                                 on_rows=_keep_partial(started, progress),
                                 progress=lambda line: progress(f"probing {line}"))
    _record_bench("memory", result, tables.memory_table(result), device, out, results, started)
