"""Options and parsers the `kvq` command's modules share."""

import logging
import sys
import time

import typer
from tqdm import tqdm

from kvq.errors import KvqError


class _Notes(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        typer.echo(f"kvq: {record.getMessage()}", err=True)  # the stderr of the moment, as typer's errors


def show_notes() -> None:
    """kvq's own notes (a built-in model's one-time conversion, a kernel's fallback to the reference) as
    `kvq: ...` lines on stderr; the library logs them and never prints."""
    notes = logging.getLogger("kvq")
    if not any(isinstance(handler, _Notes) for handler in notes.handlers):  # once per process
        notes.addHandler(_Notes())
    notes.setLevel(logging.INFO)
    notes.propagate = False


def progress_bar(desc: str):
    return lambda items: tqdm(items, desc=desc, leave=False, file=sys.stderr)


def outer_progress(desc: str):
    """Progress over a run's outer loop (cells, steps): a bar on a terminal; in a log file (stderr not a terminal)
    a line per item, since a bar that another library draws its own under (lm-eval's) makes both write
    cursor-movement codes into the file."""
    if sys.stderr.isatty():
        return lambda items: tqdm(items, desc=desc, file=sys.stderr)

    def lines(items):
        total = f"/{len(items)}" if hasattr(items, "__len__") else ""
        started = time.monotonic()
        for done, item in enumerate(items, 1):
            yield item
            typer.echo(f"{desc}: {done}{total} ({time.monotonic() - started:.0f} s)", err=True)

    return lines


def _resolve_device(value: str) -> str:
    from kvq.provenance import resolve_device

    return resolve_device(value)


def device_option():
    return typer.Option("auto", help="auto (CUDA, then MPS, then CPU), cpu, cuda or mps", callback=_resolve_device)


def window_option():
    return typer.Option(0, min=0, help="cache mode: the recent tokens each query sees exact (kvq.protocol)")


def exact_prefill_option():
    return typer.Option(False, help="cache mode: the first call (the prompt) attends over exact K/V")


MODEL_DTYPES = ("float32", "float16", "bfloat16")


def batch_size_option():
    return typer.Option(1, min=1, help="requests lm-eval hands over at once; prompts decode together where the "
                                       "quantizer allows (scores do not change)")


def decode_option():
    return typer.Option("auto", help="auto: on CUDA, generation runs through the compiled static cache where the "
                                     "quantizer packs; reference: always the reference cache")


def dtype_option():
    return typer.Option("float32", help="the model's dtype: float32, float16 or bfloat16")


def check_generation_options(decode: str, dtype: str) -> None:
    if decode not in ("auto", "reference"):
        raise KvqError(f"--decode {decode}: choose auto or reference")
    if dtype not in MODEL_DTYPES:
        raise KvqError(f"--dtype {dtype}: choose {', '.join(MODEL_DTYPES)}")


def inline_yaml(text: str, flag: str):
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:  # where the parser stopped, and what it wanted there
        mark = exc.problem_mark
        raise KvqError(f"{flag}: not YAML at character {mark.column + 1} of line {mark.line + 1} ({text!r}): "
                       f"{exc.problem}") from None
    except yaml.YAMLError as exc:
        raise KvqError(f"{flag}: not YAML: {str(exc).splitlines()[0]}") from None


def policy_from_yaml(text: str, quantized: bool = True):
    """--policy's YAML as a kvq.policy.SitePolicy (the default policy where the flag is empty); a policy over no
    quantizer (`quantized` False: every --quant is fp) is a user error."""
    from kvq.policy import parse_policy

    policy = parse_policy(inline_yaml(text, "--policy") if text else None)
    if not quantized and not policy.is_default:
        raise KvqError("--policy sets sites of a --quant quantizer; give --quant a quantizer")
    return policy


def parse_options(pairs: list[str]) -> dict:
    from kvq.quant.spec import parse_scalar

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
