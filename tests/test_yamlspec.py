import time

import pytest

from kvq.errors import KvqError
from kvq.sweep_spec import load_sweep

BASE = "name: t\nmodels: [smollm2-135m]\ngrid:\n  quantizer: [srft]\n"


def write(tmp_path, text: str):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("name: t\nname: u\nmodels: [m]\ngrid: {quantizer: [int]}\n",
         "s.yaml:2: field 'name': duplicate key (first on line 1)"),
        (BASE + "[a, b]: 1\n", "s.yaml:5: keys must be plain strings, got a list"),
        (BASE + "3: x\n", "s.yaml:5: keys must be plain strings, got '3'"),
        (BASE + "  options: [{x: !!binary aGVsbG8=}]\n", "s.yaml:5: field 'grid.options[0].x': YAML tag !!binary"),
        ("name: !!python/name:os.system t\nmodels: [m]\ngrid: {quantizer: [int]}\n",
         "s.yaml:1: field 'name': YAML tag !!python/name:os.system is not allowed"),
        (BASE + "seeds: !!set {1: null}\n", "field 'seeds': YAML tag !!set is not allowed"),
        ("base: &b {quantizer: [int]}\nname: t\nmodels: [m]\ngrid:\n  <<: *b\n",
         "s.yaml:5: field 'grid': merge keys ('<<') are not allowed"),
        (BASE + "seeds: !!int abc\n", "field 'seeds': cannot read 'abc' as !!int"),
        (BASE + "  options: [{S: 3}]\n", "s.yaml:5: field 'grid.options': srft has no option 'S'; it takes no options"),
        ("- 1\n- 2\n", "expected a mapping at the top level"),
        ("[" * 5000 + "]" * 5000, "nested too deeply"),
    ],
)
def test_strict_yaml_names_field_and_line(tmp_path, text, fragment):
    with pytest.raises(KvqError) as info:
        load_sweep(write(tmp_path, text))
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_alias_bomb_is_rejected_fast(tmp_path):
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for previous, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{previous}"] * 9) + "]")
    text = "\n".join(lines) + "\n" + BASE  # ~1 KB that expands to 9^9 strings
    assert len(text) < 1100
    started = time.perf_counter()
    with pytest.raises(KvqError, match="expands to more than"):
        load_sweep(write(tmp_path, text))
    assert time.perf_counter() - started < 1.0


def test_aliases_within_the_bound_still_work(tmp_path):
    text = ("name: t\nmodels: [m]\ngrid:\n  - {quantizer: [hqmq], options: &vq [{S: 24, r: 6}]}\n"
            "  - {quantizer: [hqmq], bits: [3], options: *vq}\n")
    spec = load_sweep(write(tmp_path, text))
    assert spec.grids[0].options == spec.grids[1].options == [{"S": 24, "r": 6}]
