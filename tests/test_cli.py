import pytest
from conftest import requires_models, run_kvq


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--bits", "1"], "bits"),
        (["--granularity", "per_group", "--group-size", "48"], "group_size 48"),
        (["--quant", "nope"], "unknown quantizer"),
        (["--mode", "both"], "mode"),
    ],
)
@requires_models
def test_bad_input_is_one_line_exit_2(args, fragment):
    done = run_kvq("ppl", *args)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in done.stderr


def test_unknown_model_lists_builtins():
    done = run_kvq("ppl", "--model", "/no/such/model/dir")
    assert done.returncode == 2
    assert "smollm2-135m" in done.stderr and "Traceback" not in done.stderr


@requires_models
def test_ppl_writes_json(tmp_path):
    out = tmp_path / "r.json"
    done = run_kvq("ppl", "--quant", "srht", "--bits", "6", "--n-windows", "1", "--seq-len", "64", "--json", str(out))
    assert done.returncode == 0, done.stderr
    import json

    record = json.loads(out.read_text())
    assert record["bits_per_element"] == 6 + 32 / 64
    assert "dPPL" in done.stdout and record["quant"]["quantizer"] == "srht"
