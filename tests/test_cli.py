from conftest import requires_models, run_kvq


@requires_models
def test_ppl_writes_json(tmp_path):
    out = tmp_path / "r.json"
    done = run_kvq("ppl", "--quant", "srht", "--bits", "6", "--n-windows", "1", "--seq-len", "64", "--json", str(out))
    assert done.returncode == 0, done.stderr
    import json

    record = json.loads(out.read_text())
    assert record["bits_per_element"] == 6 + 32 / 64
    assert "dPPL" in done.stdout and record["quant"]["quantizer"] == "srht"


@requires_models
def test_a_built_in_models_first_use_says_that_it_converts_and_later_uses_do_not(tmp_path):
    """The GGUF conversion writes a checkpoint once, before the first command using the model can start: that
    command says so in one `kvq:` line naming where; the next one, which finds the checkpoint, says nothing."""
    import os

    env = {**os.environ, "KVQ_CACHE": str(tmp_path / "cache")}
    command = ("ppl", "--model", "smollm2-135m", "--quant", "int", "--bits", "8", "--n-windows", "1", "--seq-len", "32")
    first, second = (run_kvq(*command, cwd=tmp_path, env=env) for _ in range(2))
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    notes = [line for line in first.stderr.splitlines() if "converting" in line]
    assert notes == [f"kvq: smollm2-135m: converting its GGUF to a transformers checkpoint under "
                     f"{tmp_path / 'cache' / 'models' / 'smollm2-135m'} (its first use only)"]
    assert "converting" not in second.stderr
