"""`kvq calibrate`: fit what a quantizer reads from calibration data, and save it as an artifact sweeps name."""

from pathlib import Path

import typer

from kvq.cli_common import device_option, outer_progress, progress_bar

LEARN_HELP = ("none, lambda, cayley, householder or closed_form (rotations and lambda for scalar codes), or nuq "
              "(KVQuant's per-layer signposts, from --bits, --outliers, --corpus, --n-windows and --seq-len)")


def calibrate(
    model: str = typer.Option("smollm2-135m"),
    base: str = typer.Option("srft", help="fixed base rotation: srft, srht or identity"),
    learn: str = typer.Option("householder", help=LEARN_HELP),
    bits: int = typer.Option(4),
    granularity: str = typer.Option("per_token"),
    group_size: int = typer.Option(32),
    steps: int = typer.Option(300),
    lr: float = typer.Option(5e-3),
    reflectors: int | None = typer.Option(None, help="householder reflectors (default head_dim/2)"),
    seed: int = typer.Option(0, help="seed of the base rotation's signs"),
    mode: str = typer.Option("hook"),
    outliers: float = typer.Option(0.01, help="nuq: the fraction of each vector KVQuant keeps exact"),
    corpus: str = typer.Option("shakespeare", help="its calibration split is read (never the evaluation windows)"),
    n_windows: int = typer.Option(8, help="calibration windows (from the held-out calibration split)"),
    seq_len: int = typer.Option(256),
    max_vectors: int = typer.Option(1024, help="head vectors kept per (layer, K|V)"),
    device: str = device_option(),
    out: Path = typer.Option(..., help="artifact path, e.g. runs/calib/smollm2-householder.pt"),
):
    """Learn per-site lambda and rotations on captured K/V, or fit KVQuant's nuq signposts; save an artifact
    sweeps can use."""
    if learn == "nuq":
        from kvq.quant.nuq import fit_nuq

        meta = fit_nuq(model, bits, outliers, corpus, n_windows, seq_len, out, device,
                       progress=progress_bar("fisher"))
        typer.echo(f"nuq{bits} signposts for {2 * meta['n_layers']} sites from {meta['n_windows']} x "
                   f"{meta['seq_len']} {corpus} tokens; took {meta['seconds']} s; wrote {out}")
        return
    from kvq.apply import check_mode
    from kvq.calibrate import CalibrationConfig, run_calibration
    from kvq.quant.scalar import ScalarQuantizer

    check_mode(mode)
    ScalarQuantizer(bits, granularity, group_size)
    cfg = CalibrationConfig(model, base, learn, bits, granularity, group_size, steps, lr, reflectors, seed, mode,
                            n_windows, seq_len, max_vectors, corpus)
    meta = run_calibration(cfg, out, device, window_progress=progress_bar("capture"),
                           step_progress=outer_progress(f"{learn} steps"))
    before, after = sum(meta["mse_before"].values()), sum(meta["mse_after"].values())
    typer.echo(f"{len(meta['mse_before'])} sites, {meta['parameters_per_site']} parameters per site")
    typer.echo(f"reconstruction MSE (summed over sites) {before:.6g} -> {after:.6g} "
               f"({100 * (1 - after / before):.1f}% reduction)")
    typer.echo(f"took {meta['seconds']} s; wrote {out}")
