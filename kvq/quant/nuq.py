"""KVQuant's non-uniform datatype, nuqX (Hooper et al. 2024, Sec. 3.4): per layer and per K|V, 2^b signposts in
[-1, 1] that minimise the sensitivity-weighted error sum_i F_ii (A_i - Q(A_i))^2 over calibration activations A,
F_ii the diagonal Fisher information (the squared gradient of the language-model loss at A_i), found by weighted
k-means. The official code computes F with a patched transformers (gradients/run-fisher.py: `act.grad ** 2` at
k_proj's and v_proj's outputs, one 2048-token example at a time) and fits each layer's signposts with
scikit-learn's KMeans over the activations normalised to [-1, 1] less their outliers
(quant/kvquant/simquant_module_quantizer.py, `SimQuant.quantize` with `nuq` and `fisher`).

Where kvq differs: activations are normalised as kvq's KVQuant normalises them when it runs, per vector over one
call (a calibration window: key channels over its tokens, value tokens over their channels) with its outliers set
aside (the official code's online configuration), not by offline per-channel percentile thresholds over every
calibration token; and k-means is Lloyd's in one dimension from the NormalFloat signposts, run until no signpost
moves (at most 50 rounds, the official cap), where the official code seeds scikit-learn's with k-means++.
"""

import json
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from kvq.errors import KvqError
from kvq.projections import attention_modules, split_heads
from kvq.quant.codebooks import nearest_level
from kvq.quant.spec import ROLES, Site

NUQ_FORMAT = "kvq-nuq/1"
LLOYD_ROUNDS = 50


def weighted_kmeans(points: torch.Tensor, weights: torch.Tensor, initial: torch.Tensor,
                    rounds: int = LLOYD_ROUNDS) -> torch.Tensor:
    """Lloyd's k-means on scalars, each point counted with its weight: the sorted centroids (float64). A centroid
    no weight reaches keeps its place."""
    points, weights = points.double().flatten(), weights.double().flatten()
    centroids = initial.double().sort().values
    for _ in range(rounds):
        cluster = nearest_level(points, centroids)
        mass = torch.zeros_like(centroids).index_add_(0, cluster, weights)
        moment = torch.zeros_like(centroids).index_add_(0, cluster, weights * points)
        updated = torch.where(mass > 0, moment / mass.clamp_min(torch.finfo(torch.float64).tiny), centroids)
        updated = updated.sort().values
        if torch.equal(updated, centroids):
            break
        centroids = updated
    return centroids


def weighted_error(points: torch.Tensor, weights: torch.Tensor, signposts: torch.Tensor) -> float:
    """sum_i w_i (x_i - nearest signpost)^2: the objective `weighted_kmeans` lowers."""
    points, weights = points.double().flatten(), weights.double().flatten()
    nearest = signposts.double()[(points.unsqueeze(-1) - signposts.double()).abs().argmin(-1)]
    return float((weights * (points - nearest) ** 2).sum())


def fisher_activations(model: torch.nn.Module, windows: torch.Tensor, head_dim: int,
                       progress: Callable | None = None) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """k_proj's and v_proj's outputs (the keys before RoPE, the values) on each window, with each entry's Fisher
    information: the squared gradient of the window's mean next-token loss with respect to it. By (layer, role),
    each (windows, heads, tokens, head_dim) in float32. The model's weights get no gradients."""

    outputs: dict[tuple[int, str], torch.Tensor] = {}
    found: dict[tuple[int, str], tuple[list, list]] = {}

    def keep(layer: int, role: str):
        def hook(_module, _inputs, output):
            output.retain_grad()
            outputs[(layer, role)] = output
        return hook

    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    model.requires_grad_(False)
    handles = [model.get_input_embeddings().register_forward_hook(lambda _m, _i, out: out.requires_grad_(True))]
    for attention in attention_modules(model):
        for role in ROLES:
            handles.append(getattr(attention, f"{role}_proj").register_forward_hook(keep(attention.layer_idx, role)))
    device = next(model.parameters()).device
    try:
        for window in (progress or iter)(windows.split(1)):
            outputs.clear()
            window = window.to(device)
            model(input_ids=window, labels=window, use_cache=False).loss.backward()
            for key, output in outputs.items():
                acts, fisher = found.setdefault(key, ([], []))
                acts.append(split_heads(output.detach().float(), head_dim))
                fisher.append(split_heads(output.grad.float(), head_dim) ** 2)
    finally:
        for handle in handles:
            handle.remove()
        for name, p in model.named_parameters():
            p.requires_grad_(trainable[name])
    return {key: (torch.cat(acts), torch.cat(fisher)) for key, (acts, fisher) in found.items()}


def fit_signposts(quantizer, acts: torch.Tensor, fisher: torch.Tensor) -> torch.Tensor:
    """One site's nuq signposts: weighted k-means over the activations as `quantizer` (a KVQuant) normalises them,
    outliers left out, started from its own signposts."""
    scaled, mask, _, _ = quantizer.normalized(quantizer.vectors(acts))
    weights = quantizer.vectors(fisher)
    inliers = ~mask & scaled.isfinite()
    return weighted_kmeans(scaled[inliers], weights[inliers], quantizer.signposts)


def fit_nuq(model_name: str, bits: int, outliers: float, corpus: str, n_windows: int, seq_len: int, out: Path,
            device: str = "cpu", progress: Callable | None = None) -> dict:
    """Fits every site's signposts on the corpus's calibration split and writes the artifact `datatype: nuq`
    reads (option `signposts`); returns its meta."""
    from kvq import models
    from kvq.apply import kv_geometry
    from kvq.data import token_windows
    from kvq.provenance import git_state
    from kvq.quant.kvquant import KVQuant

    started = time.time()
    starting = {role: KVQuant(role, bits, "nf", outliers) for role in ROLES}  # checks bits and outliers
    lm = models.load(model_name, device=device)
    geometry = kv_geometry(lm.model.config)
    windows = token_windows(lm.tokenizer, corpus, seq_len, n_windows, split="calib")
    captured = fisher_activations(lm.model, windows, geometry.head_dim, progress)
    signposts = {f"{layer}.{role}": [float(v) for v in fit_signposts(starting[role], acts, fisher)]
                 for (layer, role), (acts, fisher) in sorted(captured.items())}
    meta = {"model": model_name, "bits": bits, "outliers": outliers, "corpus": corpus, "n_windows": len(windows),
            "seq_len": seq_len, "n_layers": geometry.n_layers, "head_dim": geometry.head_dim,
            "commit": git_state()["commit"], "seconds": round(time.time() - started, 1)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"format": NUQ_FORMAT, "meta": meta, "signposts": signposts}, indent=1) + "\n")
    return meta


@cache
def _read(path: str, modified: int) -> dict:
    try:
        artifact = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise KvqError(f"kvquant option 'signposts': cannot read {path}: {exc}") from None
    if not isinstance(artifact, dict) or artifact.get("format") != NUQ_FORMAT:
        raise KvqError(f"kvquant option 'signposts': {path} is not a `kvq calibrate --learn nuq` artifact")
    return artifact


def site_signposts(path: str, site: Site, bits: int, outliers: float) -> tuple[float, ...]:
    """One site's fitted signposts from an artifact, after checking it was fitted for these settings and this
    model's shape."""
    where = Path(path)
    artifact = _read(str(where), where.stat().st_mtime_ns if where.is_file() else -1)
    meta = artifact["meta"]
    for name, wanted in (("bits", bits), ("outliers", outliers), ("head_dim", site.d)):
        if meta[name] != wanted:
            raise KvqError(f"kvquant option 'signposts': {path} was fitted with {name} {meta[name]}, "
                           f"this site has {wanted}")
    if f"{site.layer}.{site.role}" not in artifact["signposts"]:
        raise KvqError(f"kvquant option 'signposts': {path} was fitted on {meta['model']} ({meta['n_layers']} "
                       f"layers) and has no layer {site.layer}")
    return tuple(artifact["signposts"][f"{site.layer}.{site.role}"])
