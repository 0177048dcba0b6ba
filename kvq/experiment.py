"""One perplexity measurement: a model, token windows, and a quantizer spec on the KV path."""

from kvq import models
from kvq.apply import QuantizerBank, kv_geometry
from kvq.calibrate import load_learned
from kvq.data import DataSpec, token_windows
from kvq.policy import SitePolicy
from kvq.ppl import PplResult, Progress, perplexity
from kvq.protocol import Protocol
from kvq.quant import QuantSpec


def make_bank(model_name: str, config, spec: QuantSpec, policy: SitePolicy = SitePolicy()) -> QuantizerBank:
    """Builds (and so validates) the quantizer settings and the site policy against the model's geometry."""
    geometry = kv_geometry(config)
    learned = load_learned(spec.calibration, model_name, geometry, spec) if spec.calibration else None
    return QuantizerBank(spec, geometry, learned, policy)


def eval_windows(lm: models.LoadedModel, data: DataSpec):
    return token_windows(lm.tokenizer, data.corpus, data.seq_len, data.n_windows, split="eval")


def measure(lm: models.LoadedModel, windows, bank: QuantizerBank | None, mode: str, data: DataSpec,
            progress: Progress | None = None, protocol: Protocol = Protocol(),
            reference: list | None = None, keep_log_probs: list | None = None) -> PplResult:
    """kvq.ppl.perplexity on the data's batches: with `keep_log_probs` a list, the run's next-token
    log-probabilities are appended to it (an fp run's are the `reference` of KL metrics)."""
    return perplexity(lm.model, windows, bank, mode, data.batch_size, progress, protocol, reference, keep_log_probs)
