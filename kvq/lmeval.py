"""lm-eval with a kvq quantizer on the KV path, for loglikelihood and generation requests alike."""

from pathlib import Path

import torch
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from kvq.apply import QuantizerBank, quantized_kv
from kvq.errors import KvqError
from kvq.haystack import essays
from kvq.protocol import Protocol


class QuantizedHFLM(HFLM):
    """HFLM whose forward passes and generate() run under kvq's hook or cache quantization.

    With bank None it is the fp reference on the same code path."""

    def __init__(self, model, tokenizer, bank: QuantizerBank | None, mode: str, device: str = "cpu",
                 batch_size: int = 1, max_length: int | None = None, protocol: Protocol = Protocol()):
        super().__init__(pretrained=model, tokenizer=tokenizer, device=device, batch_size=batch_size,
                         max_length=max_length)
        self.bank = bank
        self.mode = mode
        self.protocol = protocol

    def _model_call(self, inps, attn_mask=None, labels=None):
        with torch.no_grad(), quantized_kv(self.model, self.bank, self.mode, self.protocol) as forward_kwargs:
            return self.model(inps, **forward_kwargs()).logits

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        with quantized_kv(self.model, self.bank, self.mode, self.protocol) as forward_kwargs:
            extra = forward_kwargs()
            extra.pop("use_cache")  # generation always caches; hook mode quantizes the projections anyway
            return super()._model_generate(context, max_length, stop, **generation_kwargs, **extra)


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
             device: str = "cpu", protocol: Protocol = Protocol()) -> dict:
    """One task of a LoadedModel under one quantizer (None: fp): its metrics and per-sample rows. A task named
    NAME@LENGTH is RULER's (kvq.ruler): one of its tasks, or `ruler` for the suite, at LENGTH tokens."""
    if "@" in task:
        from kvq.ruler import measure_metric

        return measure_metric(lm, bank, mode, task, limit, device, protocol)
    harness = QuantizedHFLM(lm.model, lm.tokenizer, bank, mode, device=device, protocol=protocol)
    results = evaluate(harness, [task], limit, include_path)
    return {"metrics": results["results"][task], "samples": per_sample(results, task)}


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
