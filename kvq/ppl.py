"""Perplexity of a model on token windows, optionally with a quantized KV path."""

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch

from kvq.apply import QuantizerBank, quantized_kv
from kvq.protocol import Protocol

Progress = Callable[[Iterable], Iterable]


@dataclass
class Divergence:
    """Next-token distributions against the fp model's on the same windows (as llama.cpp's KL-divergence
    statistics): mean KL(fp || quantized) over predicted tokens, per window, and how often the most likely
    token is fp's."""

    kld: float
    window_kld: list[float]
    max_window_kld: float
    top1_agreement: float


@dataclass
class PplResult:
    ppl: float
    window_ppl: list[float]
    tokens: int
    divergence: Divergence | None = None

    def to_dict(self) -> dict:
        out = asdict(self)
        if self.divergence is None:  # the records of PPL-only runs keep their form
            del out["divergence"]
        return out


@torch.no_grad()
def perplexity(model: torch.nn.Module, windows: torch.Tensor, bank: QuantizerBank | None = None,
               mode: str = "hook", batch_size: int = 2, progress: Progress | None = None,
               protocol: Protocol = Protocol(), reference: list[torch.Tensor] | None = None,
               keep_log_probs: list | None = None) -> PplResult:
    """exp(mean next-token NLL) over all predicted tokens; also per window. With `reference` (the fp model's
    next-token log-probabilities per batch, as `keep_log_probs` collects them from an fp run) also the
    Divergence from it, from the same forward passes."""
    device = next(model.parameters()).device
    batches = list(windows.split(batch_size))
    window_nll: list[torch.Tensor] = []
    window_kl: list[torch.Tensor] = []
    agreements: list[torch.Tensor] = []
    with quantized_kv(model, bank, mode, protocol) as forward_kwargs:
        for index, batch in enumerate((progress or iter)(batches)):
            batch = batch.to(device)
            logits = model(input_ids=batch, **forward_kwargs()).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="none"
            )
            window_nll.append(nll.view(batch.shape[0], -1).mean(-1).cpu())
            if reference is not None or keep_log_probs is not None:
                log_probs = logits.log_softmax(-1).cpu()
                if keep_log_probs is not None:
                    keep_log_probs.append(log_probs)
                if reference is not None:
                    fp = reference[index]
                    window_kl.append((fp.exp() * (fp - log_probs)).sum(-1).double().mean(-1))
                    agreements.append(fp.argmax(-1) == log_probs.argmax(-1))
    per_window = torch.cat(window_nll).double()
    divergence = None
    if reference is not None:
        kl = torch.cat(window_kl)
        divergence = Divergence(float(kl.mean()), kl.tolist(), float(kl.max()),
                                float(torch.cat([a.flatten() for a in agreements]).double().mean()))
    return PplResult(
        ppl=float(per_window.mean().exp()),
        window_ppl=per_window.exp().tolist(),
        tokens=int(windows.shape[0] * (windows.shape[1] - 1)),
        divergence=divergence,
    )
