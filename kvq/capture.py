"""Collecting K/V head vectors at the quantization point of a mode (for calibration)."""

import torch

from kvq.apply import KVGeometry, kv_geometry, quantized_kv
from kvq.quant.exact import Exact, ExactPacked


class _Recorder(Exact):
    """An exact site that keeps a copy of every head vector it passes through."""

    def __init__(self, store: list):
        super().__init__()
        self.store = store

    def encode(self, x: torch.Tensor) -> ExactPacked:
        self.store.append(x.detach().reshape(-1, x.shape[-1]).float().cpu())
        return super().encode(x)


class RecordingBank:
    """Stands where a QuantizerBank would and passes K/V through unchanged while keeping a copy (its keys as they
    come: centered nowhere, encoded after RoPE)."""

    def __init__(self, geometry: KVGeometry):
        self.geometry = geometry
        self.key_centers: dict[int, str] = {}
        self.pre_rope_layers: frozenset[int] = frozenset()
        self.center = None
        self.records: dict[tuple[int, str], list[torch.Tensor]] = {}

    def get(self, layer: int, role: str) -> _Recorder:
        return _Recorder(self.records.setdefault((layer, role), []))


@torch.no_grad()
def capture_kv(model, windows: torch.Tensor, mode: str, max_vectors: int, seed: int = 0,
               batch_size: int = 2, progress=None) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, role) -> (n, head_dim) vectors, a seeded subsample of at most `max_vectors` per site."""
    bank = RecordingBank(kv_geometry(model.config))
    device = next(model.parameters()).device
    with quantized_kv(model, bank, mode) as forward_kwargs:
        for batch in (progress or iter)(list(windows.split(batch_size))):
            model(input_ids=batch.to(device), **forward_kwargs())
    generator = torch.Generator().manual_seed(seed)
    captured = {}
    for key, chunks in sorted(bank.records.items()):
        vectors = torch.cat(chunks)
        if vectors.shape[0] > max_vectors:
            vectors = vectors[torch.randperm(vectors.shape[0], generator=generator)[:max_vectors]]
        captured[key] = vectors
    return captured
