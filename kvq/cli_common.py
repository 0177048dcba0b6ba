"""Options and parsers the `kvq` command's modules share."""

import sys

import typer
from tqdm import tqdm

from kvq.errors import KvqError
from kvq.quant.spec import parse_scalar


def progress_bar(desc: str):
    return lambda items: tqdm(items, desc=desc, leave=False, file=sys.stderr)


def _resolve_device(value: str) -> str:
    from kvq.provenance import resolve_device

    return resolve_device(value)


def device_option():
    return typer.Option("auto", help="auto (CUDA, then MPS, then CPU), cpu, cuda or mps", callback=_resolve_device)


def window_option():
    return typer.Option(0, min=0, help="cache mode: the recent tokens each query sees exact (kvq.protocol)")


def exact_prefill_option():
    return typer.Option(False, help="cache mode: the first call (the prompt) attends over exact K/V")


def inline_yaml(text: str, flag: str):
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise KvqError(f"{flag}: not YAML: {str(exc).splitlines()[0]}") from None


def parse_options(pairs: list[str]) -> dict:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise KvqError(f"--option takes key=value, got {pair!r}")
        options[key] = parse_scalar(value)
    return options


def floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(t) for t in text.split(","))
    except ValueError as exc:
        raise KvqError(f"expected comma-separated numbers, got {text!r}") from exc
