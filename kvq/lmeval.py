"""lm-eval with a kvq quantizer on the KV path, for loglikelihood and generation requests alike. Generation runs
batches as kvq.lmeval_decode says, through the compiled static cache on CUDA where it applies."""

import functools
from pathlib import Path

import torch
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from kvq.apply import QuantizerBank, quantized_kv
from kvq.errors import KvqError
from kvq.generate import cache_keyword
from kvq.haystack import essays
from kvq.lmeval_decode import (
    EQUAL_LENGTH,
    PADDED,
    StaticDecoder,
    equal_length_groups,
    fast_path_reason,
    reference_batching,
)
from kvq.protocol import Protocol


class QuantizedHFLM(HFLM):
    """HFLM whose forward passes and generate() run under kvq's hook or cache quantization.

    With bank None it is the fp reference on the same code path. `decode`: "auto" generates through the static
    cache where kvq.lmeval_decode.fast_path_reason allows, "reference" always through the reference cache."""

    def __init__(self, model, tokenizer, bank: QuantizerBank | None, mode: str, device: str = "cpu",
                 batch_size: int = 1, max_length: int | None = None, protocol: Protocol = Protocol(),
                 decode: str = "auto"):
        super().__init__(pretrained=model, tokenizer=tokenizer, device=device, batch_size=batch_size,
                         max_length=max_length)
        self.bank = bank
        self.mode = mode
        self.protocol = protocol
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eot_token_id
        # why generation runs through the reference cache (None: through the static cache)
        self.reference_reason = fast_path_reason(bank, mode, protocol, device) if decode == "auto" else \
            "--decode reference"
        self.static = None
        if self.reference_reason is None:
            self.static = StaticDecoder(self.model, bank, protocol, [self.eot_token_id], self.pad_token_id)

    @property
    def decoded_through(self) -> str:
        """The cache generation runs through: "static" or "reference"."""
        return "reference" if self.static is None else "static"

    @functools.cached_property
    def reference_batching(self) -> str:
        """kvq.lmeval_decode.reference_batching of the bank, probed once, when a batch first needs it."""
        return reference_batching(self.bank)

    def _model_call(self, inps, attn_mask=None, labels=None):
        with torch.no_grad(), quantized_kv(self.model, self.bank, self.mode, self.protocol) as forward_kwargs:
            return self.model(inps, **forward_kwargs()).logits

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        """The batch's continuations as HFLM returns them ((B, max_length): the padded context, then each
        prompt's new tokens, padded), each prompt's as it decodes alone (kvq.lmeval_decode)."""
        mask = generation_kwargs.pop("attention_mask", None)
        if mask is None:
            mask = torch.ones_like(context)
        new_tokens = max_length - context.shape[1]
        sampled = generation_kwargs.get("do_sample") or generation_kwargs.get("temperature", 0.0) > 0
        out = torch.full((context.shape[0], max_length), self.pad_token_id, dtype=context.dtype,
                         device=context.device)
        out[:, :context.shape[1]] = context
        if self.static is not None and not sampled:
            prompts = [row[-length:] for row, length in zip(context, mask.sum(-1).tolist(), strict=True)]
            out[:, context.shape[1]:] = self.static.continuations(prompts, new_tokens)
            return out
        if context.shape[0] == 1 or self.reference_batching == PADDED:
            done = self._reference_generate(context, max_length, stop, attention_mask=mask, **generation_kwargs)
            out[:, :done.shape[1]] = done
            return out
        for length, rows in equal_length_groups(mask):
            groups = [rows] if self.reference_batching == EQUAL_LENGTH else [[row] for row in rows]
            for group in groups:
                prompts = context[group][:, context.shape[1] - length:]
                done = self._reference_generate(prompts, length + new_tokens, stop,
                                                attention_mask=torch.ones_like(prompts), **generation_kwargs)
                out[group, context.shape[1]:context.shape[1] + done.shape[1] - length] = done[:, length:]
        return out

    def _reference_generate(self, context, max_length, stop, **generation_kwargs):
        with quantized_kv(self.model, self.bank, self.mode, self.protocol) as forward_kwargs:
            extra = forward_kwargs()
            extra.pop("use_cache")  # generation always caches; hook mode quantizes the projections anyway
            if "past_key_values" in extra:  # under the name this transformers release takes it by
                extra[cache_keyword(self.model)] = extra.pop("past_key_values")
            return super()._model_generate(context, max_length, stop, **generation_kwargs, **extra)


def stored_bits(bank: QuantizerBank | None) -> float:
    """Bits per element the run's quantizers stored (16 for fp); where every write went to the packed static
    cache, which meters nothing, its layout's bits, which the packing tests hold equal to the quantizer's."""
    if bank is None:
        return 16.0
    measured = bank.measured_bits_per_element()
    return measured if measured is not None else bank.bits_per_element(1)


def stored_bits_by_length(bank: QuantizerBank | None, protocol: Protocol, lengths) -> dict[str, float]:
    """Bits per element of the whole cache at each prompt length: stored_bits for the quantized tokens, 16 for the
    protocol's exact window (Protocol.stored_bits_per_element)."""
    bits = stored_bits(bank)
    return {str(n): protocol.stored_bits_per_element(bits, n) for n in lengths}


def task_manager(include_path: Path | None = None, metadata: dict | None = None) -> TaskManager:
    """lm-eval's tasks, with kvq's own from `include_path`; `metadata` reaches tasks that build their documents
    (RULER's lengths and tokenizer)."""
    return TaskManager(include_path=str(include_path) if include_path else None, metadata=metadata)


def evaluate(lm: QuantizedHFLM, tasks: list[str], limit: int | None, include_path: Path | None = None) -> dict:
    manager = task_manager(include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if "kvq_niah" in unknown:
        essays()  # names the install when the essays are what is missing
    if unknown:
        raise KvqError(f"unknown lm-eval task(s) {', '.join(unknown)}; kvq's own: kvq_passkey, kvq_vt, kvq_niah")
    return simple_evaluate(model=lm, tasks=tasks, limit=limit, log_samples=True, task_manager=manager,
                           bootstrap_iters=0)


def run_task(lm, bank: QuantizerBank | None, mode: str, task: str, limit: int | None, include_path: Path,
             device: str = "cpu", protocol: Protocol = Protocol(), batch_size: int = 1, decode: str = "auto") -> dict:
    """One task of a LoadedModel under one quantizer (None: fp): its metrics, per-sample rows and the cache
    generation ran through ("static" or "reference"). A task named NAME@LENGTH is RULER's (kvq.ruler): one of its
    tasks, or `ruler` for the suite, at LENGTH tokens. `batch_size` and `decode` are QuantizedHFLM's."""
    if "@" in task:
        from kvq.ruler import measure_metric

        return measure_metric(lm, bank, mode, task, limit, device, protocol)
    harness = QuantizedHFLM(lm.model, lm.tokenizer, bank, mode, device=device, protocol=protocol,
                            batch_size=batch_size, decode=decode)
    results = evaluate(harness, [task], limit, include_path)
    return {"metrics": results["results"][task], "samples": per_sample(results, task),
            "decode": harness.decoded_through}


def per_sample(results: dict, task: str) -> list[dict]:
    """doc fields, the filtered response and the per-sample metrics of one task, in doc order."""
    rows = []
    for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"]):
        response = sample["filtered_resps"][0]
        rows.append({
            "doc_id": sample["doc_id"],
            "response": response if isinstance(response, str) else list(response),
            **{k: v for k, v in sample["doc"].items() if k != "input"},
            **{m: sample[m] for m in ("acc",) if m in sample},
        })
    return rows
