"""Every user error through the real CLI: one `kvq: error:` line naming the argument or field, exit 2,
no traceback, nothing written."""

from pathlib import Path

import pytest
from conftest import assert_one_error_line, requires_models, run_kvq, run_kvq_in_one_process

SPEC = "name: t\nmodels: [smollm2-135m]\ndata: {seq_len: 32, n_windows: 1}\ngrid:\n  quantizer: [int]\n"
BOMB = "\n".join(
    ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    + [f"{n}: &{n} [" + ", ".join([f"*{p}"] * 9) + "]" for p, n in zip("abcdefgh", "bcdefghi", strict=True)]
) + "\n" + SPEC
INPUTS = {
    "binary.yaml": SPEC + "  options: [{x: !!binary aGVsbG8=}]\n",
    "listkey.yaml": SPEC + "[a, b]: 1\n",
    "pyname.yaml": SPEC.replace("name: t", "name: !!python/name:os.system t"),
    "duplicate.yaml": SPEC + "mode: hook\nmode: cache\n",
    "bomb.yaml": BOMB,
    "int-option.yaml": SPEC + "  options: [{S: 24}]\n",
    "srft-option.yaml": SPEC.replace("[int]", "[srft]") + "  options: [{rotation: srht}]\n",
    "qjl-option.yaml": SPEC.replace("[int]", "[qjl]") + "  options: [{m: 64, residual: 8}]\n",
    "seq.yaml": SPEC.replace("seq_len: 32", "seq_len: 1"),
    "not-yaml.yaml": "name: t\nmodels: [a\n",
    "corpus.bin": bytes(range(256)) * 64,
    "spec.yaml": SPEC,
    "policy-key.yaml": SPEC + "policy: {k: {bits: 8}, kv: {bits: 4}}\n",
    "policy-rule.yaml": SPEC + "policy: [{}, {layers: [{first: 2, last: 1, use: fp}]}]\n",
    "policy-range.yaml": SPEC + "policy: {layers: [{layers: [30], use: fp}]}\n",
    "policy-clash.yaml": SPEC + "policy: {layers: [{first: 2, use: fp}, {layers: ['1-3'], k: {bits: 8}}]}\n",
    "policy-field.yaml": SPEC + "policy: {v: {bitz: 4}}\n",
    "center.yaml": SPEC + "  center: [none, median]\n",
    "center-bias.yaml": SPEC + "  center: [bias]\n",
    "center-hook.yaml": SPEC + "  center: [post_rope_mean]\n",
}
NO_MODEL = [
    (["sweep"], "Missing argument 'config'"),
    (["sweep", "--bogus", "x"], "No such option: --bogus"),
    (["frobnicate"], "No such command 'frobnicate'"),
    (["ppl", "--bits", "four"], "'--bits'"),
    (["ppl", "--bits", "12"], "Invalid value for '--bits'"),
    (["ppl", "--batch-size", "0"], "'--batch-size'"),
    (["ppl", "--seq-len", "1"], "'--seq-len'"),
    (["ppl", "--device", "tpu"], "--device must be"),
    (["sweep", "missing.yaml"], "cannot read missing.yaml"),
    (["sweep", "binary.yaml"], "binary.yaml:6: field 'grid.options[0].x': YAML tag !!binary"),
    (["sweep", "listkey.yaml"], "listkey.yaml:6: keys must be plain strings"),
    (["sweep", "pyname.yaml"], "pyname.yaml:1: field 'name': YAML tag !!python/name"),
    (["sweep", "duplicate.yaml"], "duplicate.yaml:7: field 'mode': duplicate key"),
    (["sweep", "bomb.yaml"], "expands to more than"),
    (["sweep", "int-option.yaml"], "field 'grid.options': int has no option 'S'"),
    (["sweep", "center.yaml"], "field 'grid.center': 'median' is not one of none, bias, mean"),
    (["sweep", "srft-option.yaml"], "field 'grid.options': srft has no option 'rotation'"),
    (["sweep", "qjl-option.yaml"], "field 'grid.options': qjl has no option 'residual'"),
    (["sweep", "seq.yaml"], "field 'data.seq_len': too small"),
    (["sweep", "not-yaml.yaml"], "invalid YAML"),
    (["plot", "no-such-dir"], "no finished cells under no-such-dir"),
    (["compare", "int-option.yaml", "seq.yaml"], "field 'grid.options': int has no option 'S'"),
    (["compare", "spec.yaml", "spec.yaml"], "1 of 1 cells of t are not current"),
    (["ppl", "--model", "/no/such/model/dir"], "built-in models: smollm2-135m"),
    (["sweep", "policy-key.yaml"], "policy-key.yaml:6: field 'policy.kv': unknown field"),
    (["sweep", "policy-rule.yaml"], "field 'policy[1].layers[0]': give exactly one of first, last, layers"),
    (["sweep", "policy-field.yaml"], "field 'policy.v.bitz': unknown field"),
    (["ppl", "--policy", "{k: [8]}"], "policy.k: expected a mapping"),
    (["ppl", "--policy", "{k: {bits: 8}"], "--policy: not YAML at character 14 of line 1"),
    (["lmeval", "--suite", "ruler", "--tasks", "niah_single_9"], "--tasks: niah_single_9 is not a RULER task"),
    (["lmeval", "--suite", "ruler", "--tasks", "ruler_qa_squad"], "reads SQuAD v2 from the hub"),
    (["lmeval", "--suite", "longbench"], "--suite longbench is not a suite kvq runs"),
    (["lmeval", "--decode", "fast"], "--decode fast: choose auto or reference"),
    (["lmeval", "--dtype", "int8"], "--dtype int8: choose float32"),
    (["retrieval", "--decode", "fast"], "--decode fast: choose auto or reference"),
    (["retrieval", "--dtype", "half"], "--dtype half: choose float32"),
    (["retrieval", "--quant", "fp", "--policy", "{k: {bits: 8}}"], "--policy sets sites of a --quant quantizer"),
    (["lmeval", "--policy", "{k: {bits: 8}}"], "--policy sets sites of a --quant quantizer"),
    (["lmeval", "--suite", "ruler", "--lengths", "512"], "--lengths 512: RULER's generators need at least 1024"),
]
WITH_MODEL = [
    (["ppl", "--bits", "1"], "bits"),
    (["ppl", "--granularity", "per_group", "--group-size", "48"], "group_size 48"),
    (["ppl", "--quant", "nope"], "unknown quantizer"),
    (["ppl", "--mode", "both"], "mode"),
    (["ppl", "--quant", "int", "--option", "S=24"], "int has no option 'S'"),
    (["ppl", "--quant", "identity", "--option", "rotation=srft"], "identity has no option 'rotation'"),
    (["ppl", "--quant", "srht", "--option", "m=3"], "srht has no option 'm'"),
    (["ppl", "--corpus", "corpus.bin", "--n-windows", "1", "--seq-len", "32"], "corpus file corpus.bin is not UTF-8"),
    (["lmeval", "--quant", "int:4", "--tasks", "no_such_task", "--limit", "1"], "unknown lm-eval task"),
    (["sweep", "policy-range.yaml"], "policy.layers: 30 is out of range for a model of 30 layers"),
    (["sweep", "policy-clash.yaml"], "policy.layers: {first: 2} and {layers: ['1-3']} disagree on layer 1"),
    (["ppl", "--policy", "{v: {bits: 9}}"], "policy: the V quantizer of layer 0"),
    (["ppl", "--center", "bias"], "center: bias: the model's k_proj has no bias (layer 0)"),
    (["sweep", "center-bias.yaml"], "center: bias: the model's k_proj has no bias (layer 0)"),
    (["ppl", "--center", "post_rope_mean"], "hook mode quantizes k_proj's output before RoPE"),
    (["sweep", "center-hook.yaml"], "hook mode quantizes k_proj's output before RoPE"),
    (["lmeval", "--quant", "int:4,center=post_rope_mean", "--limit", "1"], "kvq lmeval does not fit key offsets"),
    (["retrieval", "--model", "smollm2-135m", "--quant", "int:4,center=post_rope_mean"],
     "kvq retrieval does not fit key offsets"),
    (["ppl", "--quant", "mlx", "--bits", "4", "--group-size", "48"],
     "mlx affine stores blocks of 48 coordinates; head_dim 64 is not a multiple of 48"),
    (["ppl", "--quant", "ggml", "--option", "type=q3_k"], "ggml option 'type' must be one of q4_0"),
    (["ppl", "--quant", "fp8", "--option", "scale=channel"], "fp8 option 'scale' must be one of unit"),
    (["lmeval", "--suite", "ruler", "--lengths", "16384"], "--lengths 16384 is over the model's context of 8192"),
    (["lmeval", "--lengths", "70", "--limit", "1"], "--lengths 70 leaves no room for filler text: the prompt"),
]


def _run_all(tmp_path_factory, cases: list) -> list[tuple]:
    """Each case in its own directory holding INPUTS, all through the CLI in one process: (directory, what it held
    before, the outcome) per case."""
    dirs = []
    for _ in cases:
        here = tmp_path_factory.mktemp("case")
        for name, content in INPUTS.items():
            path = here / name
            path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
        dirs.append(here)
    before = [_listing(d) for d in dirs]
    outcomes = run_kvq_in_one_process([(d, args) for d, (args, _) in zip(dirs, cases, strict=True)])
    return list(zip(dirs, before, outcomes, strict=True))


def _listing(directory: Path) -> list[Path]:
    return sorted(p.relative_to(directory) for p in directory.rglob("*"))


def _check_bad_input(outcome: tuple, fragment: str) -> None:
    directory, before, done = outcome
    assert_one_error_line(done, fragment)
    assert _listing(directory) == before, "a failed command wrote files"


@pytest.fixture(scope="module")
def without_model(tmp_path_factory):
    return _run_all(tmp_path_factory, NO_MODEL)


@pytest.mark.parametrize("index", range(len(NO_MODEL)), ids=[fragment for _, fragment in NO_MODEL])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(without_model, index):
    _check_bad_input(without_model[index], NO_MODEL[index][1])


def test_one_bad_input_in_a_process_of_its_own_is_one_line_too(tmp_path):
    """The batch runs every case in one process; this one runs alone, as a user's shell runs it."""
    (tmp_path / "spec.yaml").write_text(INPUTS["int-option.yaml"])
    done = run_kvq("sweep", "spec.yaml", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "kvq: error: spec.yaml:6: field 'grid.options': int has no option 'S'; it takes no options"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]


@pytest.fixture(scope="module")
def with_model(tmp_path_factory):
    """The one-time GGUF conversion (a cache fill with its own progress bar) happens first, not inside a command
    whose stderr is under test."""
    from kvq import models

    models.resolve("smollm2-135m")
    return _run_all(tmp_path_factory, WITH_MODEL)


@requires_models
@pytest.mark.parametrize("index", range(len(WITH_MODEL)), ids=[fragment for _, fragment in WITH_MODEL])
def test_bad_input_checked_against_the_model(with_model, index):
    _check_bad_input(with_model[index], WITH_MODEL[index][1])
