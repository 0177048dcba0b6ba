"""One perplexity measurement: a model, token windows, and a quantizer spec on the KV path."""

import torch

from kvq import models
from kvq.apply import QuantizerBank, kv_geometry
from kvq.calibrate import load_learned
from kvq.center import MEAN_BITS, KeyCenter, bias_offsets, bias_reason, check_center_mode, mean_offsets
from kvq.data import DataSpec, token_windows
from kvq.errors import KvqError
from kvq.policy import SitePolicy
from kvq.ppl import PplResult, Progress, perplexity
from kvq.projections import attention_by_layer
from kvq.protocol import Protocol
from kvq.quant import QuantSpec


def make_bank(model_name: str, config, spec: QuantSpec, policy: SitePolicy = SitePolicy(),
              mode: str | None = None) -> QuantizerBank:
    """Builds (and so validates) the quantizer settings and the site policy against the model's geometry (and the
    keys' centering against the mode, where given)."""
    geometry = kv_geometry(config)
    learned = load_learned(spec.calibration, model_name, geometry, spec) if spec.calibration else None
    bank = QuantizerBank(spec, geometry, learned, policy)
    if mode is not None:
        check_center_mode(bank.key_centers.values(), mode)
    if "bias" in bank.key_centers.values():
        _check_biases(config, [layer for layer, center in bank.key_centers.items() if center == "bias"])
    return bank


def refuse_centers(bank: QuantizerBank | None, command: str) -> None:
    """For commands that do not fit key offsets (lm-eval's): one line before any model loads."""
    if bank is not None and bank.key_centers:
        raise KvqError(f"center: {command} does not fit key offsets (kvq ppl, kvq sweep and kvq generate do)")


def _check_biases(config, layers: list[int]) -> None:
    """`center: bias` needs k_proj biases that offset the keys: read from the model's modules built on the meta
    device (no weights), so a bad cell fails before any loads."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    attention = attention_by_layer(model)
    for layer in layers:
        reason = bias_reason(attention[layer])
        if reason:
            raise KvqError(f"center: bias: {reason} (layer {layer})")


def fit_center(bank: QuantizerBank, lm: models.LoadedModel, data: DataSpec, mode: str) -> None:
    """Gives the bank its key offsets (kvq.center) for the loaded model: k_proj's biases, or the keys' means over
    the data's calibration split (windows of the cell's length, as many as the cell's and the split holds), once
    per bank."""
    if not bank.key_centers or bank.center is not None:
        return
    head_dim = bank.geometry.head_dim
    by_kind = {kind: [layer for layer, center in bank.key_centers.items() if center == kind]
               for kind in ("bias", "mean", "post_rope_mean")}
    offsets = bias_offsets(lm.model, by_kind["bias"], head_dim) if by_kind["bias"] else {}
    means = {}
    if by_kind["mean"] or by_kind["post_rope_mean"]:
        windows = token_windows(lm.tokenizer, data.corpus, data.seq_len, data.n_windows, "calib", at_most=True)
        for kind in ("mean", "post_rope_mean"):
            if by_kind[kind]:
                means.update(mean_offsets(lm.model, by_kind[kind], head_dim, windows, mode, data.batch_size,
                                          after_rope=kind == "post_rope_mean"))
    bank.center = KeyCenter(lm.model, {**offsets, **means}, MEAN_BITS * sum(m.numel() for m in means.values()),
                            bank.pre_rope_layers, frozenset(by_kind["post_rope_mean"]))


def eval_windows(lm: models.LoadedModel, data: DataSpec):
    return token_windows(lm.tokenizer, data.corpus, data.seq_len, data.n_windows, split="eval")


def measure(lm: models.LoadedModel, windows, bank: QuantizerBank | None, mode: str, data: DataSpec,
            progress: Progress | None = None, protocol: Protocol = Protocol(),
            reference: list | None = None, keep_log_probs: list | None = None) -> PplResult:
    """kvq.ppl.perplexity on the data's batches: with `keep_log_probs` a list, the run's next-token
    log-probabilities are appended to it (an fp run's are the `reference` of KL metrics)."""
    if bank is not None:
        fit_center(bank, lm, data, mode)
    return perplexity(lm.model, windows, bank, mode, data.batch_size, progress, protocol, reference, keep_log_probs)
