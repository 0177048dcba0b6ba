"""Post-training calibration of per-site lambda and rotations (SRFT paper Sec. 5).

Per (layer, K|V) site: capture head vectors x at the mode's quantization point, fix the base rotation
B (seeded as the quantizer seeds it), and train lambda / R by Adam to minimise the reconstruction MSE
|B^T R^T (Q(lambda * R B x) / lambda) - x|^2, rounding passed straight through. `closed_form` sets
lambda = 1 / per-channel max of the rotated activations in one pass, no training.
"""

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvq.apply import KVGeometry
from kvq.errors import KvqError
from kvq.learned import learnable_modules, parameters_per_site
from kvq.quant import Learned, QuantSpec, Site
from kvq.quant.scalar import ScalarQuantizer
from kvq.rotations import build_rotation

ARTIFACT_FORMAT = "kvq-calibration/1"
BASES = ("srft", "srht", "identity")


@dataclass(frozen=True)
class CalibrationConfig:
    model: str
    base: str = "srft"
    learn: str = "householder"
    bits: int = 4
    granularity: str = "per_token"
    group_size: int = 32
    steps: int = 300
    lr: float = 5e-3
    reflectors: int | None = None  # householder: default head_dim / 2
    seed: int = 0
    mode: str = "hook"
    n_windows: int = 8
    seq_len: int = 256
    max_vectors: int = 1024
    corpus: str = "shakespeare"

    def __post_init__(self):
        if self.base not in BASES:
            raise KvqError(f"base must be one of {', '.join(BASES)}, got {self.base!r}")
        if self.steps < 0:
            raise KvqError(f"steps must be >= 0, got {self.steps}")


@dataclass
class SiteResult:
    learned: Learned
    mse_before: float
    mse_after: float
    parameters: int


def _reconstruction(bx: torch.Tensor, quantizer: ScalarQuantizer, rotation: torch.Tensor | None,
                    lam: torch.Tensor | None) -> torch.Tensor:
    """bx (sites, n, d) base-rotated vectors through R, lambda, the quantizer and back; differentiable."""
    y = bx @ rotation.transpose(-1, -2) if rotation is not None else bx
    if lam is not None:
        y = y * lam.unsqueeze(-2)
    y_hat = quantizer.fake_quant(y)
    if lam is not None:
        y_hat = y_hat / lam.unsqueeze(-2)
    return y_hat @ rotation if rotation is not None else y_hat


def calibrate(captured: dict[tuple[int, str], torch.Tensor], geometry: KVGeometry,
              cfg: CalibrationConfig, progress: Callable | None = None,
              device: str = "cpu") -> dict[tuple[int, str], SiteResult]:
    """Trains every site at once on `device` (see kvq.learned); `progress` wraps the step loop.
    The learned tensors come back on the CPU."""
    keys = sorted(captured)
    sites = [Site(layer, role, geometry.head_dim) for layer, role in keys]
    counts = {captured[k].shape[0] for k in keys}
    if len(counts) != 1:
        raise KvqError(f"sites captured different vector counts {sorted(counts)}; cannot batch them")
    quantizer = ScalarQuantizer(cfg.bits, cfg.granularity, cfg.group_size)
    bx = torch.stack([
        build_rotation(cfg.base, site.d, site.seed(cfg.seed)).forward(captured[key].float())
        for key, site in zip(keys, sites, strict=True)
    ]).to(device)
    modules = learnable_modules(cfg.learn, len(keys), geometry.head_dim, cfg.reflectors, cfg.seed).to(device)

    def current() -> tuple[torch.Tensor | None, torch.Tensor | None]:
        rotation = modules["rotation"]() if "rotation" in modules else None
        return rotation, (modules["lam"]() if "lam" in modules else None)

    def site_mse(rotation, lam) -> torch.Tensor:
        return ((_reconstruction(bx, quantizer, rotation, lam) - bx) ** 2).mean(dim=(-2, -1))

    with torch.no_grad():
        before = site_mse(None, None)
    parameters = parameters_per_site(modules)
    if cfg.learn == "closed_form":
        amax = bx.abs().amax(dim=-2)
        rotation, lam = None, 1 / torch.where(amax > 0, amax, torch.ones_like(amax))
        parameters = geometry.head_dim
    else:
        if parameters:
            optimizer = torch.optim.Adam(modules.parameters(), lr=cfg.lr)
            for _ in (progress or iter)(range(cfg.steps)):
                optimizer.zero_grad()
                # Sites share no parameters, so the summed loss trains each site on its own MSE.
                site_mse(*current()).sum().backward()
                optimizer.step()
        with torch.no_grad():
            rotation, lam = current()
    with torch.no_grad():
        after = site_mse(rotation, lam)
    return {
        key: SiteResult(
            Learned(cfg.seed, None if rotation is None else rotation[i].cpu().clone(),
                    None if lam is None else lam[i].cpu().clone()),
            float(before[i]), float(after[i]), parameters,
        )
        for i, key in enumerate(keys)
    }


def _site_key(layer: int, role: str) -> str:
    return f"{layer}.{role}"


def save_artifact(path: Path, cfg: CalibrationConfig, geometry: KVGeometry,
                  results: dict[tuple[int, str], SiteResult], extra: dict) -> None:
    sites = {_site_key(*key): {"rotation": r.learned.rotation, "lam": r.learned.lam} for key, r in results.items()}
    meta = {
        **asdict(cfg),
        "head_dim": geometry.head_dim,
        "n_layers": geometry.n_layers,
        "parameters_per_site": next(iter(results.values())).parameters if results else 0,
        "mse_before": {_site_key(*k): r.mse_before for k, r in results.items()},
        "mse_after": {_site_key(*k): r.mse_after for k, r in results.items()},
        **extra,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"format": ARTIFACT_FORMAT, "meta": meta, "sites": sites}, tmp)
    tmp.replace(path)


def read_artifact(path: str | Path) -> dict:
    path = Path(path)
    try:
        artifact = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise KvqError(f"calibration artifact {path} does not exist (make it with `kvq calibrate`)") from exc
    except Exception as exc:  # torch raises several types for a file that is not an artifact
        raise KvqError(f"{path} is not a kvq calibration artifact: {str(exc).splitlines()[0]}") from exc
    if not isinstance(artifact, dict) or artifact.get("format") != ARTIFACT_FORMAT:
        raise KvqError(f"{path} is not a kvq calibration artifact")
    return artifact


def calibration_summary(path: str | Path) -> dict:
    """What a result should say about the artifact it used."""
    meta = read_artifact(path)["meta"]
    before, after = sum(meta["mse_before"].values()), sum(meta["mse_after"].values())
    return {
        "path": str(path), "base": meta["base"], "learn": meta["learn"], "steps": meta["steps"],
        "parameters_per_site": meta["parameters_per_site"], "commit": meta.get("commit"),
        "mse_reduction": 1 - after / before if before else 0.0,
    }


def load_learned(path: str | Path, model: str, geometry: KVGeometry, spec: QuantSpec) -> dict[tuple[int, str], Learned]:
    """The per-site learned pieces of an artifact, after checking it fits this model and quantizer."""
    artifact = read_artifact(path)
    meta = artifact["meta"]
    if meta["model"] != model:
        raise KvqError(f"calibration {path} was made for model {meta['model']!r}, not {model!r}")
    if meta["head_dim"] != geometry.head_dim or meta["n_layers"] != geometry.n_layers:
        raise KvqError(
            f"calibration {path} has head_dim {meta['head_dim']} x {meta['n_layers']} layers; "
            f"the model has {geometry.head_dim} x {geometry.n_layers}"
        )
    quantizer_base = "identity" if spec.quantizer == "int" else spec.quantizer
    if meta["base"] != quantizer_base:
        raise KvqError(f"calibration {path} was trained on base {meta['base']!r}; use quantizer {meta['base']!r}")
    learned = {}
    for key, site in artifact["sites"].items():
        layer, role = key.split(".")
        learned[(int(layer), role)] = Learned(meta["seed"], site["rotation"], site["lam"])
    return learned


def run_calibration(cfg: CalibrationConfig, out: Path, device: str = "cpu", window_progress=None,
                    step_progress=None) -> dict:
    """Capture on calibration windows, train every site, save the artifact; returns its meta."""
    from kvq import models
    from kvq.apply import kv_geometry
    from kvq.capture import capture_kv
    from kvq.data import token_windows
    from kvq.provenance import git_state

    started = time.time()
    lm = models.load(cfg.model, device=device)
    geometry = kv_geometry(lm.model.config)
    windows = token_windows(lm.tokenizer, cfg.corpus, cfg.seq_len, cfg.n_windows, split="calib")
    captured = capture_kv(lm.model, windows, cfg.mode, cfg.max_vectors, cfg.seed, progress=window_progress)
    results = calibrate(captured, geometry, cfg, step_progress, device)
    extra = {"commit": git_state()["commit"], "seconds": round(time.time() - started, 1)}
    save_artifact(out, cfg, geometry, results, extra)
    return read_artifact(out)["meta"]
