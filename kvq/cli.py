"""The `kvq` command. Thin: parse, call the library, print."""

import contextlib
import sys
from pathlib import Path

import typer

from kvq.cli_bench import bench_app
from kvq.cli_calibrate import calibrate
from kvq.cli_common import (
    batch_size_option,
    check_generation_options,
    decode_option,
    device_option,
    dtype_option,
    exact_prefill_option,
    floats,
    outer_progress,
    parse_options,
    policy_from_yaml,
    progress_bar,
    show_notes,
    window_option,
)
from kvq.errors import KvqError

try:  # typer raises its own click fork's usage errors from 0.2x on, click's before
    from typer import TyperException as UsageError
except ImportError:
    from click import ClickException as UsageError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="KV-cache quantization research harness.")


@app.command()
def ppl(
    model: str = typer.Option("smollm2-135m", help="built-in name, HF id or local path"),
    quant: str = typer.Option("srft", help="quantizer name (kvq list)"),
    bits: int = typer.Option(4, min=1, max=8, help="2-8 for scalar codes; TurboQuant also 1"),
    granularity: str = typer.Option("per_token", help="per_token|per_channel|per_group|per_channel_group"),
    group_size: int = typer.Option(32, min=1),
    asymmetric: bool = typer.Option(False, help="asymmetric (zero point) instead of symmetric"),
    scale_dtype: str = typer.Option("float32"),
    seed: int = typer.Option(0),
    option: list[str] = typer.Option([], help="method-specific key=value, repeatable"),
    calibration: Path | None = typer.Option(None, help="artifact from `kvq calibrate`"),
    center: str = typer.Option("none", help="keys less a known offset before encoding: none, bias, mean or "
                                            "post_rope_mean"),
    policy: str = typer.Option("", help="per-site policy as YAML, e.g. '{k: {bits: 8}, layers: [{first: 2, "
                                        "use: fp}]}' (kvq.policy); the options above are its base"),
    kld: bool = typer.Option(False, help="also KL(fp || quantized) and top-1 agreement with fp"),
    mode: str = typer.Option("hook", help="hook (k_proj/v_proj outputs) or cache (post-RoPE at cache write)"),
    window: int = window_option(),
    exact_prefill: bool = exact_prefill_option(),
    corpus: str = typer.Option("shakespeare", help="shakespeare, a local .txt file/dir, or hf:<dataset>"),
    seq_len: int = typer.Option(256, min=2),
    n_windows: int = typer.Option(8, min=1),
    batch_size: int = typer.Option(2, min=1),
    device: str = device_option(),
    json_out: Path | None = typer.Option(None, "--json", help="write the result as JSON here"),
):
    """Perplexity of one model under one quantizer (or per-site policy), against its fp baseline."""
    from kvq import models
    from kvq.apply import check_mode, check_protocol
    from kvq.data import DataSpec
    from kvq.experiment import eval_windows, make_bank, measure
    from kvq.protocol import Protocol
    from kvq.provenance import provenance
    from kvq.quant import QuantSpec
    from kvq.report import ppl_report
    from kvq.store import write_json_atomic

    spec = QuantSpec(quant, bits, granularity, group_size, not asymmetric, scale_dtype, seed, parse_options(option),
                     str(calibration) if calibration else None, center)
    site_policy = policy_from_yaml(policy)
    data = DataSpec(corpus, seq_len, n_windows, batch_size)
    protocol = check_protocol(check_mode(mode), Protocol(window, exact_prefill))
    bank = make_bank(model, models.load_config(model), spec, site_policy, mode)
    lm = models.load(model, device=device)
    windows = eval_windows(lm, data)
    reference = [] if kld else None
    base = measure(lm, windows, None, mode, data, progress_bar("fp baseline"), keep_log_probs=reference)
    quantized = measure(lm, windows, bank, mode, data, progress_bar(spec.label()), protocol, reference)
    quantized_bits = bank.measured_bits_per_element()
    bits_per_element = protocol.stored_bits_per_element(quantized_bits, seq_len)
    shown_protocol = f"  protocol {protocol.label()}" if not protocol.is_default else ""
    shown_policy = f"  policy {site_policy.label()}" if not site_policy.is_default else ""
    typer.echo(f"model {model}  mode {mode}  quantizer {spec.label()}{shown_policy}  windows {n_windows}x{seq_len}"
               f"{shown_protocol}")
    typer.echo(ppl_report(base, quantized, bits_per_element, quantized_bits if shown_protocol else None))
    if json_out:
        record = {
            "model": model, "mode": mode, "quant": spec.to_dict(), "policy": site_policy.to_dict(),
            "data": data.to_dict(), "protocol": protocol.to_dict(), "bits_per_element": bits_per_element,
            "quantized_bits_per_element": quantized_bits, "fp": base.to_dict(), "quantized": quantized.to_dict(),
            "dppl": quantized.ppl - base.ppl, **provenance(device),
        }
        write_json_atomic(json_out, record)
        typer.echo(f"wrote {json_out}")


@app.command()
def sweep(
    config: Path = typer.Argument(..., help="sweep YAML, e.g. configs/qwen_4bit.yaml"),
    runs_dir: Path = typer.Option(Path("runs"), help="cells go to <runs-dir>/<sweep name>/"),
    results: Path = typer.Option(Path("RESULTS.md"), help="ledger the finished sweep appends to"),
    status: bool = typer.Option(False, "--status", "--dry-run",
                                help="list the spec's cells as current/todo/stale, and records not in it; run nothing"),
    force: bool = typer.Option(False, help="recompute every cell and fp baseline"),
    device: str = typer.Option("auto", help="auto, cpu, cuda, cuda:N or mps; under ray / slurm, where cells run "
                                            "(auto: cuda when each cell gets GPUs)"),
    executor: str = typer.Option(None, help="local (default), ray or slurm; also `executor: {name: ...}` in the YAML"),
    ray_address: str = typer.Option(None, help="ray: a running cluster (host:port, or auto); default starts one here"),
    gpus: float = typer.Option(None, help="ray / slurm: GPUs per cell"),
    cpus: float = typer.Option(None, help="ray / slurm: CPUs per cell"),
    retries: int = typer.Option(None, help="ray / slurm: runs again a cell whose worker died, this many times"),
    partition: str = typer.Option(None, help="slurm: partition"),
    time_limit: int = typer.Option(None, "--time", help="slurm: minutes per job"),
    cells_per_job: int = typer.Option(None, help="slurm: cells per array job"),
    cluster: str = typer.Option(None, help="slurm: 'slurm', or 'local' to run the jobs as processes here"),
):
    """Run every cell of a YAML sweep (resumable), then plot and append a finding to RESULTS.md."""
    from kvq.sweep_spec import load_sweep

    spec = load_sweep(config)  # a bad sweep file is reported before the measuring path is imported
    from kvq import executors
    from kvq.executors.driver import SweepIncomplete
    from kvq.ledger import append_finding
    from kvq.plot import plot_metric_vs_bits
    from kvq.report import status_report, sweep_finding
    from kvq.results import load_files
    from kvq.sweep import sweep_dir, sweep_status

    settings = executors.executor_settings(config, {
        "name": executor, "address": ray_address, "gpus": gpus, "cpus": cpus, "retries": retries,
        "partition": partition, "time": time_limit, "cells_per_job": cells_per_job, "cluster": cluster})
    device = executors.sweep_device(settings, device)
    if status:
        typer.echo(status_report(sweep_status(spec, runs_dir, device, settings.threads), sweep_dir(runs_dir, spec)))
        return
    try:
        outcome = executors.run(spec, settings, runs_dir, force, device,
                                cell_progress=outer_progress("cells"),
                                # a window bar nests under the cells bar, and nested bars redraw with
                                # cursor-moving escape codes: on a terminal only, never into a log file
                                window_progress=progress_bar if sys.stderr.isatty() else None)
    except KeyboardInterrupt:
        typer.echo("kvq: sweep interrupted; finished cells are saved, rerun the same command to resume", err=True)
        sys.exit(130)
    except SweepIncomplete as exc:
        typer.echo(f"kvq: error: {exc}", err=True)
        sys.exit(1)
    others = f", {len(outcome.by_others)} finished by a concurrent run" if outcome.by_others else ""
    typer.echo(f"{len(outcome.ran)} cells ran, {len(outcome.skipped)} already done{others} -> {outcome.directory}")
    if outcome.removed_temporaries:
        typer.echo(f"removed {len(outcome.removed_temporaries)} staging files left by killed writers")
    frame = load_files(outcome.paths)
    metrics = ["dppl", "kld"] if "kld" in spec.metrics else ["dppl"]
    figures = [path for metric in metrics for path in plot_metric_vs_bits(frame, outcome.directory / "figures", metric)]
    finding = sweep_finding(spec, frame, outcome.directory, figures, "kvq " + " ".join(sys.argv[1:]))
    appended = append_finding(results, finding.title, finding.body, finding.key)
    if not appended.new:
        typer.echo(f"finding unchanged: {results} item {appended.number} already reports these cells; "
                   "appended nothing")
        return
    typer.echo(f"appended finding {appended.number} to {results}")
    typer.echo(finding.body)


@app.command()
def compare(
    config: Path = typer.Argument(..., help="sweep YAML whose cells set the order, e.g. configs/faithful_methods.yaml"),
    second: Path = typer.Argument(..., help="the same grid on another corpus, e.g. configs/faithful_methods_gpl3.yaml"),
    runs_dir: Path = typer.Option(Path("runs"), help="where both sweeps' cells are"),
    device: str = device_option(),
):
    """Two finished sweeps side by side per model and protocol: dPPL on each corpus, their rank correlation."""
    from kvq.records import RecordBook
    from kvq.report import corpus_agreement
    from kvq.results import load_files
    from kvq.sweep import sweep_dir, sweep_status
    from kvq.sweep_spec import load_sweep

    frames, names = [], []
    for path in (config, second):
        spec = load_sweep(path)
        states = [s for s in sweep_status(spec, runs_dir, device) if s.cell is not None]
        missing = [s for s in states if s.state != "current"]
        if missing:
            raise KvqError(f"{len(missing)} of {len(states)} cells of {spec.name} are not current "
                           f"(first: {missing[0].cell_id}, {missing[0].detail}); run kvq sweep {path} first")
        book = RecordBook(sweep_dir(runs_dir, spec), device)
        frames.append(load_files(book.cell_path(s.cell) for s in states))
        names.append(Path(spec.data.corpus).name)
    table = corpus_agreement(*frames, *names)
    if not table:
        raise KvqError(f"{config} and {second} share no configuration (model, protocol and quantizer)")
    typer.echo(table)




app.command()(calibrate)


@app.command()
def plot(
    path: Path = typer.Argument(..., help="a sweep folder under runs/"),
    out: Path | None = typer.Option(None, help="figure folder (default <path>/figures)"),
    y: str = typer.Option("dppl", help="the y axis: dppl, or kld (KL to fp, for cells measured with metrics: kld)"),
):
    """Metric vs bits/element figures (PNG + PDF) from sweep results, the Pareto frontier marked."""
    from kvq.plot import METRIC_AXES, plot_metric_vs_bits
    from kvq.results import load

    if y not in METRIC_AXES:
        raise KvqError(f"--y must be one of {', '.join(METRIC_AXES)}, got {y!r}")
    frame = load(path)
    if frame.empty:
        raise KvqError(f"no finished cells under {path}")
    if y == "kld" and frame.kld.isna().all():
        raise KvqError(f"no cell under {path} was measured with metrics: kld")
    for figure in plot_metric_vs_bits(frame, out or Path(path) / "figures", y):
        typer.echo(f"wrote {figure}")


@app.command()
def lmeval(
    model: str = typer.Option("smollm2-135m"),
    quant: str = typer.Option("fp", help="fp, or NAME[:BITS[:GRANULARITY[:GROUP]]][,key=value...]"),
    policy: str = typer.Option("", help="per-site policy as YAML over --quant (kvq.policy), e.g. '{k: {bits: 8}}'"),
    suite: str | None = typer.Option(None, help="ruler: RULER's synthetic tasks, offline, at --lengths"),
    tasks: str | None = typer.Option(None, help="comma-separated lm-eval tasks (default kvq_passkey; with "
                                                  "--suite ruler, its 11 synthetic tasks)"),
    limit: int | None = typer.Option(None, help="documents per task (per task and length with --suite ruler)"),
    mode: str = typer.Option("cache"),
    window: int = window_option(),
    exact_prefill: bool = exact_prefill_option(),
    lengths: str = typer.Option("512,1024", help="context lengths in tokens: of kvq_* tasks, or of --suite ruler"),
    depths: str = typer.Option("0,0.25,0.5,0.75,1", help="kvq_* task needle depths"),
    max_new_tokens: int | None = typer.Option(None, help="--suite ruler: tokens generated per answer (default: "
                                                         "each task's own)"),
    batch_size: int = batch_size_option(),
    decode: str = decode_option(),
    dtype: str = dtype_option(),
    prepare_only: bool = typer.Option(False, "--prepare-only", help="--suite ruler: generate and keep the "
                                      "documents this run reads (under $KVQ_CACHE/ruler), run no model"),
    device: str = device_option(),
    json_out: Path | None = typer.Option(None, "--json"),
):
    """lm-eval tasks with a quantized KV cache (loglikelihood and generation requests), or RULER's suite."""
    import torch

    from kvq import models
    from kvq.apply import check_mode, check_protocol
    from kvq.experiment import make_bank, refuse_centers
    from kvq.protocol import Protocol
    from kvq.provenance import provenance
    from kvq.quant.spec import parse_spec
    from kvq.store import write_json_atomic

    if suite not in (None, "ruler"):
        raise KvqError(f"--suite {suite} is not a suite kvq runs; it runs ruler")
    check_generation_options(decode, dtype)
    spec = parse_spec(quant)
    site_policy = policy_from_yaml(policy, quantized=spec is not None)
    protocol = check_protocol(check_mode(mode), Protocol(window, exact_prefill))
    length_list = [int(x) for x in floats(lengths)]
    if suite == "ruler":
        from kvq.report import ruler_table
        from kvq.ruler import (
            SYNTHETIC_TASKS,
            UNAVAILABLE_OFFLINE,
            check_installed,
            check_lengths,
            check_tasks,
            run_ruler,
        )

        task_list = check_tasks(tasks.split(",") if tasks else list(SYNTHETIC_TASKS))
        check_installed()
        check_lengths(length_list, models.load_config(model))
        if prepare_only:
            from transformers import AutoTokenizer

            from kvq.ruler import prepare_documents

            with contextlib.redirect_stdout(sys.stderr):
                prepare_documents(AutoTokenizer.from_pretrained(models.resolve(model)), task_list, length_list, limit)
            typer.echo(f"kept RULER's documents for {len(task_list)} task(s) at {lengths} under "
                       f"{models.cache_dir() / 'ruler'}")
            return
    else:
        task_list = (tasks or "kvq_passkey").split(",")
    bank = make_bank(model, models.load_config(model), spec, site_policy) if spec else None
    refuse_centers(bank, "kvq lmeval")
    lm = models.load(model, device=device, dtype=getattr(torch, dtype))
    from kvq.lmeval import stored_bits  # lm-eval's import is slow: after every argument check

    record = {"model": model, "mode": mode, "protocol": protocol.to_dict(), "quant": spec.to_dict() if spec else None,
              "policy": site_policy.to_dict(), "dtype": dtype}
    if suite == "ruler":
        with contextlib.redirect_stdout(sys.stderr):  # RULER's generators print their sizing; stdout is the table
            result = run_ruler(lm, bank, mode, task_list, length_list, limit, device, protocol, max_new_tokens,
                               batch_size, decode)
        bits = stored_bits(bank)
        typer.echo(ruler_table(result["scores"], result["suite"]))
        why = f" ({result['reference_reason']})" if result["reference_reason"] else ""
        typer.echo(f"bits/element {bits:.4f}; decoded through the {result['decode']} cache{why}; unavailable "
                   f"offline: {', '.join(UNAVAILABLE_OFFLINE)}")
        record = {"format": "kvq-ruler/1", **record, "bits_per_element": bits, "lengths": length_list,
                  "max_new_tokens": max_new_tokens, "batch_size": batch_size, **result,
                  "unavailable_offline": list(UNAVAILABLE_OFFLINE)}
    else:
        from kvq.lmeval import QuantizedHFLM, evaluate, per_sample
        from kvq.longctx import RetrievalSpec, write_tasks

        folder = write_tasks(lm.tokenizer, RetrievalSpec(tuple(length_list), floats(depths)),
                             models.cache_dir() / "tasks", only=task_list)
        harness = QuantizedHFLM(lm.model, lm.tokenizer, bank, mode, device=device, protocol=protocol,
                                batch_size=batch_size, decode=decode)
        results = evaluate(harness, task_list, limit, folder)
        record["bits_per_element"] = stored_bits(bank)
        for task, metrics in results["results"].items():
            shown = {k: v for k, v in metrics.items() if isinstance(v, float)}
            typer.echo(f"{task}: " + ", ".join(f"{k} {v:.4f}" for k, v in shown.items()))
        record = {"format": "kvq-lmeval/1", **record, "results": results["results"],
                  "samples": {t: per_sample(results, t) for t in task_list}}
    if json_out:
        write_json_atomic(json_out, {**record, **provenance(device)})
        typer.echo(f"wrote {json_out}")


@app.command()
def retrieval(
    model: str = typer.Option("qwen2.5-coder-0.5b"),
    quant: list[str] = typer.Option(["fp", "int:4"], help="repeatable: fp or NAME[:BITS[:GRANULARITY[:GROUP]]][,k=v]"),
    policy: str = typer.Option("", help="per-site policy as YAML over each quantized --quant, e.g. '{k: {bits: 8}}'"),
    task: str = typer.Option("kvq_passkey", help="kvq_passkey, kvq_vt or kvq_niah (needle-in-a-haystack)"),
    lengths: str = typer.Option("512,1024,2048"),
    depths: str = typer.Option("0,0.25,0.5,0.75,1"),
    samples: int = typer.Option(1, help="documents per (length, depth)"),
    mode: str = typer.Option("cache"),
    window: int = window_option(),
    exact_prefill: bool = exact_prefill_option(),
    out: Path = typer.Option(Path("runs/retrieval")),
    results: Path = typer.Option(Path("RESULTS.md")),
    batch_size: int = batch_size_option(),
    decode: str = decode_option(),
    dtype: str = dtype_option(),
    device: str = device_option(),
):
    """Retrieval accuracy vs context length and depth per quantizer: JSON, table, heatmap, RESULTS.md item."""
    check_generation_options(decode, dtype)
    from kvq.apply import check_mode, check_protocol
    from kvq.ledger import append_finding
    from kvq.longctx import RetrievalSpec
    from kvq.protocol import Protocol
    from kvq.quant.spec import parse_spec
    from kvq.report import retrieval_finding
    from kvq.retrieval import accuracy_frame, accuracy_table, heatmap, run_retrieval

    protocol = check_protocol(check_mode(mode), Protocol(window, exact_prefill))
    specs = [parse_spec(q) for q in quant]
    spec = RetrievalSpec(tuple(int(x) for x in floats(lengths)), floats(depths), samples)
    records = run_retrieval(model, specs, spec, mode, task, out, device, protocol=protocol, batch_size=batch_size,
                            decode=decode, dtype=dtype, policy=policy_from_yaml(policy, quantized=any(specs)))
    frame = accuracy_frame(records)
    table = accuracy_table(frame)
    figures = heatmap(frame, out / f"{model}-{task}-heatmap", f"{task} on {model} ({mode} mode)")
    typer.echo(table)
    finding = retrieval_finding(f"kvq {' '.join(sys.argv[1:])}", model, task, spec, len(frame) // len(records), table,
                                out, figures)
    number = append_finding(results, finding.title, finding.body).number
    typer.echo(f"appended finding {number} to {results}")


@app.command()
def generate(
    prompt: list[str] = typer.Option(..., help="repeatable: one completion per prompt, batched"),
    model: str = typer.Option("smollm2-135m"),
    quant: str = typer.Option("fp", help="fp or NAME[:BITS[:GRANULARITY[:GROUP]]][,k=v] with a packed layout"),
    max_new_tokens: int = typer.Option(64),
    temperature: float = typer.Option(0.0, help="0: greedy"),
    top_k: int = typer.Option(0, help="sample from the k most likely tokens (0: all)"),
    top_p: float = typer.Option(1.0, help="sample from the smallest set of tokens whose probability reaches p"),
    seed: int = typer.Option(0, help="seeds the sampling"),
    stop: list[str] = typer.Option([], help="repeatable: one-token stop strings (default: end of sequence)"),
    window: int = typer.Option(16, min=1, help="quantized cache: the newest tokens kept exact"),
    policy: str = typer.Option("", help="per-site policy as YAML over --quant (kvq.policy), e.g. '{k: {bits: 8}}'"),
    center_corpus: str = typer.Option("shakespeare", help="text whose calibration split gives keys centered by "
                                                          "their mean (center=post_rope_mean) that mean"),
    device: str = device_option(),
):
    """Continue prompts through a static cache (fp16, or a quantizer's packed layout), compiled on CUDA."""
    from kvq import models
    from kvq.generate import Sampling, complete
    from kvq.quant.spec import parse_spec

    sampling = Sampling(temperature, top_k or None, top_p, seed)
    spec = parse_spec(quant)
    import torch

    lm = models.load(model, device, torch.float16 if device.startswith("cuda") else torch.float32)
    stream = (lambda text: typer.echo(text, nl=False)) if len(prompt) == 1 else None
    texts = complete(lm, prompt, spec, max_new_tokens, sampling=sampling, stop=stop or None, window=window,
                     on_text=stream, policy=policy_from_yaml(policy, quantized=spec is not None),
                     center_corpus=center_corpus)
    if stream is not None:
        typer.echo()
        return
    for text in texts:
        typer.echo(text)
        typer.echo("---")


app.add_typer(bench_app, name="bench")


@app.command("list")
def list_names():
    """Built-in models, quantizers and granularities."""
    from kvq.models import BUILTINS
    from kvq.quant import QUANTIZERS, describe
    from kvq.quant.scalar import GRANULARITIES

    typer.echo("models:")
    for builtin in BUILTINS.values():
        typer.echo(f"  {builtin.name:22s} {builtin.description}")
    typer.echo("quantizers (spec fields they read; options with defaults):")
    for name in QUANTIZERS.names():
        typer.echo(f"  {name:10s} {describe(QUANTIZERS.get(name))}")
    typer.echo("granularities: " + ", ".join(GRANULARITIES))


def _quiet_libraries() -> None:
    """kvq draws its own progress bars; library warnings would break one-line errors. Said through the variables
    transformers and huggingface_hub read when first imported, so a command that fails on its arguments imports
    neither (a user's own settings stand)."""
    import logging
    import os
    import warnings

    for variable, value in (("TRANSFORMERS_VERBOSITY", "error"), ("HF_HUB_VERBOSITY", "error"),
                            ("HF_HUB_DISABLE_PROGRESS_BARS", "1")):
        os.environ.setdefault(variable, value)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    # transformers 5.2x renamed forward's `past_key_values` to `cache` and warns at every call under the old name,
    # which the perplexity path still passes (releases before 5.2 know only it): one warning per cell of a sweep
    warnings.filterwarnings("ignore", message="`past_key_values` is deprecated", category=FutureWarning)


def _fail(message: str) -> None:
    """A user error: one line on stderr, exit 2."""
    typer.echo("kvq: error: " + " ".join(message.split()), err=True)
    sys.exit(2)


def main() -> None:
    _quiet_libraries()
    show_notes()
    try:
        app(standalone_mode=False)
    except KvqError as exc:
        _fail(str(exc))
    except UsageError as exc:  # a missing, unknown or unparsable argument
        _fail(exc.format_message())
    except OSError as exc:
        if exc.filename is None:  # not about a path the user named: a fault, shown in full
            raise
        _fail(f"{exc.filename2 or exc.filename}: {exc.strerror}")  # filename2: the target of a rename
    except (typer.Abort, KeyboardInterrupt):
        typer.echo("kvq: interrupted", err=True)
        sys.exit(130)
