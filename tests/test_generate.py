"""kvq.generate: the product's decode loop against transformers' generate (greedy tokens equal, one prompt or a
padded batch, fp16 or kvq's static cache), seeded sampling, stop tokens, cache reuse, the compiled step on CUDA, and
`kvq generate`'s errors."""

import pytest
import torch
from conftest import assert_one_error_line, requires_cuda, requires_models, run_kvq, run_kvq_in_one_process
from transformers import LlamaConfig, LlamaForCausalLM

from kvq import generate
from kvq.errors import KvqError
from kvq.gqa_attention import GQA_SDPA_ATTENTION
from kvq.quant import QuantSpec
from kvq.static_cache import StaticQuantizedLayer


def _static_cache(kind: str, model, batch: int, max_tokens: int):
    """fp16, kvq's SRFT int4, or KIVI-4 in 16-token key groups (the window holding one)."""
    if kind == "kivi":
        return generate.static_cache(model, QuantSpec("kivi", 4, group_size=16), batch, max_tokens, window=16)
    spec = None if kind in ("fp16", "fp16-gqa") else QuantSpec("srft", 4, "per_group", 16)
    return generate.static_cache(model, spec, batch, max_tokens, window=8)


def _wide_model(device: str):
    """A tiny random Llama whose weights are drawn wide enough that a step one position off changes its greedy
    tokens, with no EOS token (which the loop does not treat apart and generate suppresses under
    min_new_tokens), and a batch-3 prompt for it."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=101, initializer_range=0.2,
                         eos_token_id=None)
    model = LlamaForCausalLM(config).eval().to(device, torch.float16 if device == "cuda" else torch.float32)
    return model, torch.randint(1, 101, (3, 24), generator=torch.Generator().manual_seed(2)).to(device)


GPU = [requires_cuda, pytest.mark.gpu]
# The compiled step's tokens are compared whole only with the fp16 cache: with a quantized one, a last-bit
# difference between compiled and eager kernels flips a key's code now and then, and later steps attend to it,
# so on this wide-weight model the two decodes drift apart with no fault in either (the compiled step is
# checked step by step instead, below).
# "fp16-gqa": the fp16 static cache under kvq.gqa_attention's SDPA, against generate under transformers' sdpa.
STEP_LOOPS = [pytest.param("cpu", "fp16", False), pytest.param("cpu", "kvq", False),
              pytest.param("cpu", "kivi", False), pytest.param("cpu", "fp16-gqa", False),
              pytest.param("cuda", "fp16", False, marks=GPU), pytest.param("cuda", "kvq", False, marks=GPU),
              pytest.param("cuda", "fp16", True, marks=GPU), pytest.param("cuda", "fp16-gqa", True, marks=GPU)]


def _attention(kind: str) -> str | None:
    return GQA_SDPA_ATTENTION if kind == "fp16-gqa" else None


@pytest.mark.parametrize(("device", "kind", "compiled"), STEP_LOOPS)
@pytest.mark.parametrize("chunk", [None, 10])
def test_the_loop_decodes_the_greedy_tokens_of_transformers_generate(device, kind, compiled, chunk):
    """kvq.generate.generate (its plain step, or the compiled one replayed as a CUDA graph) against generate run
    eagerly with the same kind of static cache and the model's own attention: the same 48 tokens at batch 3, the
    prompt prefilled whole or in chunks."""
    model, prompt = _wide_model(device)
    steps = 48
    runs, marks = {}, []
    for loop in ("generate", "step"):
        cache = _static_cache(kind, model, 3, 24 + steps)
        attention = _attention(kind) if loop == "step" else None
        with torch.no_grad(), generate.decode_routing(model, cache, attention):
            if loop == "step":
                runs[loop] = torch.stack(generate.generate(model, prompt, cache, steps, prefill_chunk=chunk,
                                                           compiled=compiled, on_token=marks.append))
            else:
                runs[loop] = model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache,
                                            max_new_tokens=steps, do_sample=False, prefill_chunk_size=chunk,
                                            disable_compile=True)[:, 24:]
    assert runs["step"].shape == (3, steps) and len(marks) == steps
    assert torch.equal(runs["step"], runs["generate"])


def _cache_state(cache) -> list[torch.Tensor]:
    """Every tensor the layers of a static cache keep, in a fixed order: what a decode step reads and writes."""
    state = []
    for layer in cache.layers:
        if isinstance(layer, StaticQuantizedLayer):
            state += layer._tensors()
        else:
            state += [value for _, value in sorted(vars(layer).items()) if isinstance(value, torch.Tensor)]
    return state


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("kind", ["fp16", "kvq"])
# batch 1 is where gpt-fast's tuning turns the weight matmuls into inductor's own reductions
@pytest.mark.parametrize(("batch", "tuned_gemv"), [(3, False), (1, True)])
def test_the_compiled_step_picks_the_plain_steps_token_from_the_same_cache(kind, batch, tuned_gemv):
    """The step loop's compiled step (a CUDA graph, under either of the loop's compile options) against a plain
    forward, 47 decode steps on the wide-weight model, each step taken from the same cache state: the
    plain cache's tensors are copied into the compiled step's before it, so the two differ only by one step's
    rounding, which cannot compound through flipped codes. The compiled step's token is the plain step's
    argmax wherever the plain logits' top two are further apart than rounding moves them."""
    model, prompt = _wide_model("cuda")
    prompt = prompt[:batch]
    steps, margin = 47, 0.1
    plain, graphed = (_static_cache(kind, model, batch, 24 + steps + 1) for _ in range(2))
    # as in the loop: past its graph limit dynamo would fall back to the plain step without saying so
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=generate.STEP_GRAPHS,
                                                     fail_on_recompile_limit_hit=True):
        for cache in (plain, graphed):  # the loop's prefill alone: its first token, no step
            with generate.decode_routing(model, cache):
                token = torch.stack(generate.generate(model, prompt, cache, 1, compiled=False))
        compared = 0
        for step in range(steps):
            position = torch.tensor([24 + step], device="cuda")
            rows = position.expand(batch, 1)
            for source, target in zip(_cache_state(plain), _cache_state(graphed), strict=True):
                target.copy_(source)
            with generate.decode_routing(model, graphed):
                step_fn = generate._compiled(generate._greedy_step, tuned_gemv)
                compiled_token = step_fn(model, graphed, token, position, rows, None,
                                         generate.cache_keyword(model)).clone()
            with generate.decode_routing(model, plain):
                logits = model(input_ids=token, position_ids=position[None], cache_position=position,
                               past_key_values=plain, use_cache=True).logits[:, -1]
            top_two = logits.float().topk(2).values
            clear = top_two[:, 0] - top_two[:, 1] > margin
            assert torch.equal(compiled_token[clear], logits.argmax(-1, keepdim=True)[clear]), step
            compared += int(clear.sum())
            token = logits.argmax(-1, keepdim=True)
    assert compared >= 0.75 * batch * steps  # the margin leaves most tokens compared


@pytest.mark.parametrize(("device", "compiled"), [("cpu", False), pytest.param("cuda", True, marks=GPU)])
@pytest.mark.parametrize("kind", ["fp16", "kvq"])
def test_a_cache_reused_through_reset_decodes_each_prompt_as_a_fresh_cache_does(device, compiled, kind):
    """The step loop over one cache reset between prompts gives each prompt the tokens a fresh cache gives it
    (nothing the last prompt wrote leaks into the next), and under the compiled step the reset cache replays
    the CUDA graph its first prompt recorded, where a fresh cache makes the step record another."""
    model, first = _wide_model(device)
    prompts = (first, torch.randint(1, 101, first.shape, generator=torch.Generator().manual_seed(3)).to(device))

    def decode(cache, prompt):
        with torch.no_grad(), generate.decode_routing(model, cache):
            return torch.stack(generate.generate(model, prompt, cache, 24, compiled=compiled))

    # The fresh caches stay alive while the reused one is allocated: a freed one's device addresses could be
    # handed to it, and the compiled step would then replay that cache's graph instead of recording one.
    fresh_caches = [_static_cache(kind, model, 3, 48) for _ in prompts]
    fresh = [decode(fresh_cache, prompt) for fresh_cache, prompt in zip(fresh_caches, prompts, strict=True)]
    cache = _static_cache(kind, model, 3, 48)
    reused, recorded = [], []
    for prompt in prompts:
        cache.reset()
        before = generate.graphs_recorded()
        reused.append(decode(cache, prompt))
        recorded.append(generate.graphs_recorded() - before)
    assert not torch.equal(fresh[0], fresh[1])
    for got, want in zip(reused, fresh, strict=True):
        assert torch.equal(got, want)
    if compiled:
        assert recorded[0] > 0 and recorded[1] == 0


PAD = 0


def _ragged_prompts(lengths) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, 101, (n,), generator=g) for n in lengths]


def _hf_generate(model, prompts, cache, steps: int) -> list[torch.Tensor]:
    """transformers' generate, left-padded as kvq.generate pads, greedy, eager."""
    ids, real = generate.left_padded(prompts, PAD, model.device)
    mask = torch.ones_like(ids) if real is None else real
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=steps, min_new_tokens=steps,
                         do_sample=False, pad_token_id=PAD, disable_compile=True)
    return list(out[:, ids.shape[1]:])


@pytest.mark.parametrize("kind", ["fp16", "kvq"])
@pytest.mark.parametrize("lengths", [(24,), (24, 17, 9, 20)])
def test_greedy_tokens_equal_transformers_generate_for_one_prompt_and_a_padded_batch(kind, lengths):
    """Batch 1, and a batch of 4 prompts of different lengths (left-padded, masked): each row's 32 tokens equal
    transformers' generate's with the same kind of static cache; a padded batch's rows also equal each prompt
    decoded alone (the padding changes nothing)."""
    model, _ = _wide_model("cpu")
    prompts = _ragged_prompts(lengths)
    steps = 32
    ours, theirs = [], []
    for run, out in ((generate.generate, ours), (None, theirs)):
        cache = _static_cache(kind, model, len(prompts), max(lengths) + steps)
        with torch.no_grad(), generate.decode_routing(model, cache):
            if run is None:
                out += _hf_generate(model, prompts, cache, steps)
            else:
                out += run(model, prompts, cache, steps, pad_token_id=PAD)
    for mine, reference in zip(ours, theirs, strict=True):
        assert torch.equal(mine, reference)
    if len(prompts) > 1 and kind == "fp16":
        for prompt, mine in zip(prompts, ours, strict=True):
            cache = _static_cache(kind, model, 1, len(prompt) + steps)
            with torch.no_grad():
                alone = generate.generate(model, [prompt], cache, steps)[0]
            assert torch.equal(alone, mine)


def _sample(model, prompts, sampling, steps=24, stop=()):
    cache = _static_cache("fp16", model, len(prompts), 24 + steps)
    with torch.no_grad():
        return generate.generate(model, prompts, cache, steps, sampling=sampling, stop_tokens=stop)


def test_seeded_sampling_repeats_and_its_limits_reduce_to_greedy():
    model, prompt = _wide_model("cpu")
    hot = generate.Sampling(temperature=1.5, top_k=50, top_p=0.95, seed=7)
    first, again = _sample(model, prompt, hot), _sample(model, prompt, hot)
    other = _sample(model, prompt, generate.Sampling(temperature=1.5, top_k=50, top_p=0.95, seed=8))
    greedy = _sample(model, prompt, generate.Sampling())
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, greedy, strict=True))
    for narrow in (generate.Sampling(temperature=1.5, top_k=1, seed=3), generate.Sampling(1.5, None, 1e-6, seed=3)):
        assert all(torch.equal(a, b) for a, b in zip(_sample(model, prompt, narrow), greedy, strict=True))


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = set()
    for seed in range(200):
        generator = torch.Generator().manual_seed(seed)
        seen.add(int(generate.choose(logits, generate.Sampling(1.0, None, 0.8), generator)))
    assert seen == {0, 1}


def test_a_stop_token_ends_its_row_and_the_loop_ends_when_every_row_has():
    model, prompt = _wide_model("cpu")
    greedy = _sample(model, prompt, generate.Sampling(), steps=40)
    stop = int(greedy[0][5])
    first = int((greedy[0] == stop).nonzero()[0])
    stopped = _sample(model, prompt, generate.Sampling(), steps=40, stop=[stop])
    assert torch.equal(stopped[0], greedy[0][: first + 1])
    for row, full in zip(stopped[1:], greedy[1:], strict=True):
        hits = (full == stop).nonzero()
        assert torch.equal(row, full[: int(hits[0]) + 1] if len(hits) else full)
    every = {int(row[3]) for row in greedy}
    shortest = _sample(model, prompt, generate.Sampling(), steps=40, stop=sorted(every))
    assert all(len(row) <= 4 for row in shortest)


@pytest.mark.parametrize("kwargs,fragment", [
    ({"max_new_tokens": 0}, "--max-new-tokens must be at least 1"),
    ({"max_new_tokens": 30}, "the cache holds 48 tokens; a 24-token prompt and 30 new tokens need 53"),
    ({"prompts": [torch.tensor([], dtype=torch.long)]}, "every prompt needs at least one token"),
    ({"prefill_chunk": 0}, "--prefill-chunk must be a positive number"),
])
def test_generate_refuses_what_it_cannot_do(kwargs, fragment):
    model, prompt = _wide_model("cpu")
    args = {"prompts": prompt, "max_new_tokens": 8, **kwargs}
    with pytest.raises(KvqError, match=fragment):
        generate.generate(model, args.pop("prompts"), _static_cache("fp16", model, 3, 48), args.pop("max_new_tokens"),
                          **args)


@pytest.mark.parametrize("sampling,fragment", [({"top_p": 0.0}, "--top-p must be in"), ({"top_p": 1.5}, "--top-p"),
                                               ({"temperature": -1}, "--temperature"), ({"top_k": 0}, "--top-k")])
def test_sampling_settings_are_checked(sampling, fragment):
    with pytest.raises(KvqError, match=fragment):
        generate.Sampling(**sampling)


@pytest.mark.gpu
@requires_cuda
def test_on_a_gpu_a_layout_without_a_fused_decode_kernel_is_refused():
    """A static cache whose decode steps would attend through the reference on CUDA (here KIVI's keys in 8-token
    groups, under the kernels' 16) is refused at build, naming the layer and why; the same layout with a group the
    kernel reads, and TurboQuant's codebook codes, are built."""
    model, _ = _wide_model("cuda")
    with pytest.raises(KvqError, match=r"kivi:4: no fused decode kernel on cuda.*layer 0: per-channel key stats "
                                       r"need a power-of-two token group >= 16, got 8"):
        generate.static_cache(model, QuantSpec("kivi", 4, group_size=8), 1, 64)
    for spec in (QuantSpec("kivi", 4, group_size=16), QuantSpec("kivi", 2, group_size=16), QuantSpec("turbo", 3)):
        assert generate.static_cache(model, spec, 1, 64, window=16).decode_kernel_reason(4) is None


def test_a_static_cache_centering_its_keys_is_fitted_before_it_is_built():
    """center: post_rope_mean: static_cache hands the bank to `fit_center` before building the cache, whose layers
    then store the keys less the offsets it fitted; without one the cache refuses the bank."""
    model, _ = _wide_model("cpu")
    spec = QuantSpec("srft", 4, "per_group", 16, center="post_rope_mean")
    offsets = {layer: torch.full((2, 32), float(layer + 1)) for layer in range(2)}

    def fit(bank):
        from kvq.center import KeyCenter

        bank.center = KeyCenter(model, offsets, 0, fixed=frozenset(offsets))

    cache = generate.static_cache(model, spec, 1, 32, window=8, fit_center=fit)
    for index, layer in enumerate(cache.layers):
        assert torch.equal(layer.head_offsets, offsets[index])
    with pytest.raises(KvqError, match="not fitted"):
        generate.static_cache(model, spec, 1, 32, window=8)


BAD_GENERATE_ARGUMENTS = [
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--prompt", ""], "--prompt 2 is empty"),
    (["--quant", "hqmq:4"], "the static quantized cache stores packed layouts only"),
    (["--quant", "kivi:4", "--max-new-tokens", "40"],
     "codes whose stats span 32 tokens (KIVI's keys) need a window of at least 32 tokens, got 16"),
    (["--stop", "two words"], "a stop string must be one token"),
    (["--policy", "{k: {bits: 8}}"], "--policy sets sites of a --quant quantizer"),
    (["--quant", "int:4", "--policy", "{layers: [{first: 1, k: {center: mean}}]}"], "not by center: mean's"),
    (["--quant", "int:4,center=post_rope_mean", "--center-corpus", "/no/such/text"], "unknown corpus '/no/such/text'"),
]


@pytest.fixture(scope="module")
def bad_generate_runs(tmp_path_factory):
    return run_kvq_in_one_process([
        (tmp_path_factory.mktemp("generate"), ["generate", "--prompt", "To be", "--max-new-tokens", "4", "--device",
                                               "cpu", *args]) for args, _ in BAD_GENERATE_ARGUMENTS])


@requires_models
@pytest.mark.model
@pytest.mark.parametrize("index", range(len(BAD_GENERATE_ARGUMENTS)), ids=[f for _, f in BAD_GENERATE_ARGUMENTS])
def test_kvq_generate_bad_arguments_are_one_line_and_exit_2(bad_generate_runs, index):
    assert_one_error_line(bad_generate_runs[index], BAD_GENERATE_ARGUMENTS[index][1])


@requires_models
@pytest.mark.model
def test_kvq_generate_on_a_built_in_model_continues_each_prompt_as_transformers_does(tmp_path):
    """`kvq generate` (fp16 static cache under kvq.gqa_attention) against transformers' generate with a dynamic
    cache: the same greedy text for two prompts of different lengths."""
    from conftest import loaded

    lm = loaded("smollm2-135m")
    prompts = ["To be, or not to be", "The king"]
    done = run_kvq("generate", *(a for p in prompts for a in ("--prompt", p)), "--max-new-tokens", "12",
                   "--device", "cpu", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    texts = done.stdout.split("\n---\n")
    for prompt, text in zip(prompts, texts[:2], strict=True):
        ids = lm.tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                    pad_token_id=lm.tokenizer.eos_token_id)
        expected = lm.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert text.strip("\n") == expected


@requires_models
@pytest.mark.model
def test_kvq_generate_follows_its_policy(tmp_path):
    """2-bit keys and values decode another text than fp's; with every layer kept exact by the policy, fp's."""
    fp = ["generate", "--prompt", "To be, or not to be", "--max-new-tokens", "16", "--device", "cpu"]
    quantized = [*fp, "--quant", "int:2"]
    runs = run_kvq_in_one_process([(tmp_path, fp), (tmp_path, quantized),
                                   (tmp_path, [*quantized, "--policy", "{layers: [{first: 30, use: fp}]}"])])
    assert all(done["code"] == 0 for done in runs), [done["stderr"] for done in runs]
    fp_text, quantized_text, kept_exact_text = (done["stdout"] for done in runs)
    assert kept_exact_text == fp_text != quantized_text
