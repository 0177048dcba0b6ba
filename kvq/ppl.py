"""Perplexity of a model on token windows, optionally with a quantized KV path."""

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch

from kvq.apply import QuantizerBank, quantized_kv
from kvq.protocol import Protocol

Progress = Callable[[Iterable], Iterable]


@dataclass
class PplResult:
    ppl: float
    window_ppl: list[float]
    tokens: int

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def perplexity(model: torch.nn.Module, windows: torch.Tensor, bank: QuantizerBank | None = None,
               mode: str = "hook", batch_size: int = 2, progress: Progress | None = None,
               protocol: Protocol = Protocol()) -> PplResult:
    """exp(mean next-token NLL) over all predicted tokens; also per window."""
    device = next(model.parameters()).device
    batches = list(windows.split(batch_size))
    window_nll: list[torch.Tensor] = []
    with quantized_kv(model, bank, mode, protocol) as forward_kwargs:
        for batch in (progress or iter)(batches):
            batch = batch.to(device)
            logits = model(input_ids=batch, **forward_kwargs()).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="none"
            )
            window_nll.append(nll.view(batch.shape[0], -1).mean(-1).cpu())
    per_window = torch.cat(window_nll).double()
    return PplResult(
        ppl=float(per_window.mean().exp()),
        window_ppl=per_window.exp().tolist(),
        tokens=int(windows.shape[0] * (windows.shape[1] - 1)),
    )
