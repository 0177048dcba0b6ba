"""Per-sample scoring for kvq's generated lm-eval tasks (copied beside the task YAML at generation)."""

import re


def passkey(doc, results):
    found = re.search(r"\d+", results[0])
    return {"acc": float(found is not None and found.group(0) == doc["target"])}


def variable_tracking(doc, results):
    names = doc["target"].split()
    return {"acc": sum(name in results[0] for name in names) / len(names)}


def facts(doc, results):
    """The fraction of the needle's facts ('|'-separated) the answer holds."""
    wanted = doc["target"].split("|")
    return {"acc": sum(fact.lower() in results[0].lower() for fact in wanted) / len(wanted)}
