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
