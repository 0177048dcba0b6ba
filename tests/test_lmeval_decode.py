"""How the lm-eval harness decodes batches (kvq.lmeval_decode): which quantizers let padding or batch-mates into
a prompt's codes, and that a batch gives every prompt the continuation it gets alone, through the reference cache
and the static cache on CPU and through the compiled static cache on CUDA."""

from dataclasses import dataclass

import pytest
import torch
from conftest import loaded, requires_cuda, requires_models
from lm_eval.api.instance import Instance

from kvq.apply import KVGeometry, QuantizerBank, kv_geometry
from kvq.lmeval import QuantizedHFLM
from kvq.lmeval_decode import (
    EQUAL_LENGTH,
    ONE_BY_ONE,
    PADDED,
    StaticDecoder,
    equal_length_groups,
    fast_path_reason,
    reference_batching,
)
from kvq.policy import parse_policy
from kvq.protocol import Protocol
from kvq.quant import QUANTIZERS, QuantizerConfig, QuantSpec, Site
from kvq.quant.base import Packed, Quantizer

GEOMETRY = KVGeometry(n_layers=2, n_kv_heads=2, head_dim=64)


def bank(name: str, bits: int, granularity: str = "per_token") -> QuantizerBank:
    return QuantizerBank(QuantSpec(name, bits, granularity), GEOMETRY)


def test_per_token_codes_take_a_padded_batch_and_kivis_channel_groups_prompts_of_equal_length():
    assert reference_batching(None) == PADDED
    assert reference_batching(bank("int", 4)) == PADDED and reference_batching(bank("turbo", 4)) == PADDED
    assert reference_batching(bank("kivi", 2)) == EQUAL_LENGTH  # a key channel's scale spans a group of positions


class WholeTensorScale(Quantizer):
    """int8 codes under one absmax scale over everything encoded at once: the batch's rows share it."""

    def encode(self, x: torch.Tensor) -> Packed:
        scale = x.abs().amax().clamp_min(1e-8) / 127
        return TensorScalePacked(torch.round(x / scale).to(torch.int8), scale, x.dtype)

    def decode(self, packed: Packed) -> torch.Tensor:
        return (packed.codes.float() * packed.scale).to(packed.dtype)

    def bits_per_element(self, d: int, n_tokens: int) -> float:
        return 8.0


@dataclass
class TensorScalePacked(Packed):
    codes: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


@dataclass(frozen=True)
class WholeTensorScaleConfig(QuantizerConfig):
    name = "whole_tensor_scale"  # registered by the test alone: its one scale is no method's contract
    seeded = False

    def build(self, site: Site, seed: int) -> Quantizer:
        return WholeTensorScale()


def test_a_scale_over_the_whole_batch_decodes_prompt_by_prompt(monkeypatch):
    monkeypatch.setitem(QUANTIZERS._entries, WholeTensorScaleConfig.name, WholeTensorScaleConfig)
    assert reference_batching(bank(WholeTensorScaleConfig.name, 8)) == ONE_BY_ONE


def test_the_locality_probes_leave_the_banks_storage_meters_alone():
    kivi = bank("kivi", 2)
    before = kivi.measured_bits_per_element()
    reference_batching(kivi)
    assert kivi.measured_bits_per_element() == before


def test_equal_length_groups_split_a_left_padded_batch_longest_first():
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [0, 1, 1]])
    assert equal_length_groups(mask) == [(3, [1]), (2, [0, 3]), (1, [2])]


def test_the_static_path_needs_cuda_a_packed_layout_and_a_protocol_it_holds():
    cuda = "cuda"
    assert "CUDA" in fast_path_reason(None, "cache", Protocol(16, True), "cpu")
    assert fast_path_reason(None, "cache", Protocol(16, True), cuda) is None
    assert fast_path_reason(bank("int", 4), "cache", Protocol(16, True), cuda) is None
    assert "KIVI" in fast_path_reason(bank("kivi", 4), "cache", Protocol(16, True), cuda)
    assert fast_path_reason(bank("turbo", 4), "cache", Protocol(16, True), cuda) is None  # a decode kernel reads it
    assert "window" in fast_path_reason(bank("int", 4), "cache", Protocol(0, True), cuda)
    assert "window" in fast_path_reason(bank("int", 4), "cache", Protocol(16, False), cuda)
    assert "hook" in fast_path_reason(bank("int", 4), "hook", Protocol(), cuda)
    # per-site policies: layers kept exact are plain fp static layers, K and V codes of two widths are held, keys
    # centered are not
    k8v4 = QuantizerBank(QuantSpec("int", 4), GEOMETRY, policy=parse_policy({"k": {"bits": 8}}))
    assert fast_path_reason(k8v4, "cache", Protocol(16, True), cuda) is None
    centered = QuantizerBank(QuantSpec("int", 4, center="bias"), GEOMETRY)
    assert "center: bias" in fast_path_reason(centered, "cache", Protocol(16, True), cuda)
    first_fp = parse_policy({"layers": [{"first": 1, "use": "fp"}]})
    boundary = QuantizerBank(QuantSpec("int", 4), GEOMETRY, policy=first_fp)
    assert fast_path_reason(boundary, "cache", Protocol(16, True), cuda) is None
    kivi_past_boundary = QuantizerBank(QuantSpec("kivi", 4), GEOMETRY, policy=first_fp)
    assert "layer 1 K" in fast_path_reason(kivi_past_boundary, "cache", Protocol(16, True), cuda)


def _requests(tokenizer, new_tokens: int) -> list[Instance]:
    """Prompts of three lengths, two of one length, as lm-eval hands them over."""
    base = "The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire. " * 6
    contexts = [base + "Remember 41973. ", base, base + "Remember 41973. " * 3, base + "Remember 55555. "]
    return [Instance("generate_until", {}, (context + "The number to remember is",
                                            {"until": [], "max_gen_toks": new_tokens, "do_sample": False}), index)
            for index, context in enumerate(contexts)]


def _continuations(lm, quantizers, batch_size: int, device: str, protocol: Protocol, decode: str = "auto"):
    harness = QuantizedHFLM(lm.model, lm.tokenizer, quantizers, "cache", device=device, batch_size=batch_size,
                            protocol=protocol, decode=decode)
    return harness, harness.generate_until(_requests(lm.tokenizer, 12), disable_tqdm=True)


@requires_models
@pytest.mark.model
@pytest.mark.parametrize("spec", [None, QuantSpec("int", 4), QuantSpec("kivi", 2)], ids=["fp", "int4", "kivi2"])
def test_a_batch_gives_each_prompt_its_own_continuation(spec):
    """Padded (fp, per-token int4) and equal-length (KIVI-2) batches decode as each prompt does alone."""
    lm = loaded("smollm2-135m")
    quantizers = QuantizerBank(spec, kv_geometry(lm.model.config)) if spec else None
    protocol = Protocol(0, True)
    _, alone = _continuations(lm, quantizers, 1, "cpu", protocol)
    harness, together = _continuations(lm, quantizers, 4, "cpu", protocol)
    assert harness.reference_batching == (EQUAL_LENGTH if spec and spec.quantizer == "kivi" else PADDED)
    assert "CUDA" in harness.reference_reason
    assert together == alone and any(text.strip() for text in alone)


@requires_models
@pytest.mark.model
@pytest.mark.parametrize("spec", [None, QuantSpec("int", 4)], ids=["fp", "int4"])
def test_the_static_cache_gives_each_prompt_of_a_padded_batch_its_own_continuation(spec):
    """The static decoder takes lm-eval's padded batch at once: each row's tokens are those it decodes alone."""
    lm = loaded("smollm2-135m")
    quantizers = QuantizerBank(spec, kv_geometry(lm.model.config)) if spec else None
    decoder = StaticDecoder(lm.model, quantizers, Protocol(16, True), [lm.tokenizer.eos_token_id], 0)
    prompts = [torch.tensor(lm.tokenizer(r.args[0])["input_ids"]) for r in _requests(lm.tokenizer, 12)]
    assert len({p.numel() for p in prompts}) == 3  # a padded batch
    together = decoder.continuations(prompts, 12)
    alone = torch.cat([decoder.continuations([p], 12) for p in prompts])
    assert together.shape == (4, 12) and torch.equal(together, alone)
    assert len(set(map(tuple, together.tolist()))) > 1  # the prompts' answers differ


@requires_models
@pytest.mark.model
def test_a_batch_that_fits_a_static_cache_already_built_decodes_in_it(monkeypatch):
    """lm-eval's tasks ask for different numbers of new tokens: a later batch that a cache built for its rows can
    hold decodes in that cache (so in its compiled step), and only one it cannot hold builds another."""
    from kvq.static_cache import StaticQuantizedCache

    lm = loaded("smollm2-135m")
    built, allocate = [], StaticQuantizedCache.allocate
    monkeypatch.setattr(StaticQuantizedCache, "allocate", lambda cache, model, rows: (
        built.append(rows), allocate(cache, model, rows))[1])
    quantizers = QuantizerBank(QuantSpec("int", 4), kv_geometry(lm.model.config))
    decoder = StaticDecoder(lm.model, quantizers, Protocol(16, True), [lm.tokenizer.eos_token_id], 0)
    prompt = torch.tensor(lm.tokenizer("To be, or not to be, that is the question: " * 8)["input_ids"])
    decoder.continuations([prompt, prompt], 4)
    decoder.continuations([prompt[:-20], prompt[:-20]], 24)  # fewer prompt tokens, more new ones
    assert built == [2]
    decoder.continuations([prompt], 4)  # another number of rows
    decoder.continuations([prompt.repeat(24), prompt.repeat(24)], 4)  # more tokens than the first cache holds
    assert built == [2, 1, 2]


@requires_cuda
@requires_models
@pytest.mark.gpu
@pytest.mark.parametrize("spec", [None, QuantSpec("int", 4)], ids=["fp16", "int4"])
def test_on_cuda_the_static_path_answers_as_the_reference_cache_does(spec):
    """The compiled static cache holds the reference protocol (exact prefill, window 16): greedy answers agree,
    up to a rare near-tie that a last-bit difference between the kernels and the reference arithmetic flips.
    Qwen2.5-Coder, the model of the GPU RULER study."""
    lm = loaded("qwen2.5-coder-0.5b")
    lm.model.to("cuda", torch.float16)
    try:
        quantizers = QuantizerBank(spec, kv_geometry(lm.model.config)) if spec else None
        protocol = Protocol(16, True)
        fast, fast_texts = _continuations(lm, quantizers, 4, "cuda", protocol)
        reference, reference_texts = _continuations(lm, quantizers, 4, "cuda", protocol, decode="reference")
    finally:
        lm.model.to("cpu", torch.float32)
    assert fast.static is not None and fast.reference_reason is None and reference.static is None
    assert sum(a == b for a, b in zip(fast_texts, reference_texts, strict=True)) >= 3
