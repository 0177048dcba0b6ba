"""A method added in one file: registered at its config class, it is listed, takes its YAML and CLI fields,
and passes the contract every built-in quantizer passes, with no edit anywhere else."""

import sys
from dataclasses import dataclass

import pytest
import torch
from test_quantizer_contract import (
    assert_is_a_function_of_its_seed,
    assert_keeps_shape_and_dtype_and_measures_the_bits_it_states,
    assert_packed_layout_round_trips_through_the_ops,
)
from typer.testing import CliRunner

from kvq.cli import app, main
from kvq.errors import KvqError
from kvq.quant import QuantizerConfig, QuantSpec, Site, build_quantizer, register_quantizer
from kvq.quant.base import Packed, Quantizer
from kvq.sweep_spec import expand, load_sweep


@dataclass
class ToyPacked(Packed):
    codes: torch.Tensor  # int8 multiples of the step
    dtype: torch.dtype


class ToyQuantizer(Quantizer):
    """Rounds every coordinate to a multiple of `step`, kept as int8."""

    def __init__(self, step: float):
        self.step = step

    def encode(self, x: torch.Tensor) -> ToyPacked:
        return ToyPacked(torch.round(x.float() / self.step).clamp(-128, 127).to(torch.int8), x.dtype)

    def decode(self, packed: ToyPacked) -> torch.Tensor:
        return (packed.codes.float() * self.step).to(packed.dtype)

    def bits_per_element(self, d: int, n_tokens: int) -> float:
        return 8.0


@register_quantizer("toy")
@dataclass(frozen=True)
class ToyConfig(QuantizerConfig):
    step: float = 0.25
    seeded = False

    def build(self, site: Site, seed: int) -> Quantizer:
        return ToyQuantizer(self.step)


def test_toy_is_listed_with_its_options():
    result = CliRunner().invoke(app, ["list"])
    assert result.exit_code == 0
    assert "toy" in result.output and "step: float = 0.25; unseeded" in result.output


def test_toy_takes_its_yaml_fields(tmp_path):
    spec = tmp_path / "toy.yaml"
    spec.write_text("name: toy\nmodels: [smollm2-135m]\nseeds: [0, 1]\ngrid:\n  quantizer: [toy]\n"
                    "  options: [{step: 0.5}, {step: 1}]\n")
    cells = expand(load_sweep(spec))
    assert [cell.quant.options for cell in cells] == [{"step": 0.5}, {"step": 1}]  # unseeded: one seed each
    assert build_quantizer(cells[0].quant, Site(0, "k", 8)).step == 0.5
    spec.write_text("name: toy\nmodels: [smollm2-135m]\ngrid:\n  quantizer: [toy]\n  options: [{stride: 2}]\n")
    with pytest.raises(KvqError, match="toy has no option 'stride'; options: step"):
        load_sweep(spec)


def test_toy_takes_its_cli_fields(monkeypatch, capsys):
    """In process, where the toy is registered: the CLI's own entry point, one line and exit 2."""
    monkeypatch.setattr(sys, "argv", ["kvq", "ppl", "--quant", "toy", "--option", "step=wide"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == "kvq: error: toy option 'step' must be float, got 'wide'"


@pytest.mark.parametrize("role", ["k", "v"])
def test_toy_passes_the_quantizer_contract(role):
    assert_keeps_shape_and_dtype_and_measures_the_bits_it_states("toy", role)
    assert_is_a_function_of_its_seed("toy")
    for granularity in ("per_token", "per_group"):
        assert_packed_layout_round_trips_through_the_ops("toy", granularity)
    assert build_quantizer(QuantSpec("toy", options={"step": 0.5}), Site(0, role, 8)).step == 0.5


def test_a_cell_of_the_toy_digests_its_module_beside_the_shared_path():
    """A quantizer registered outside kvq (here, by this test module) is what its cells run: its source is in their
    code digest, named by its file name, and in no other cell's."""
    from kvq.fingerprint import code_version, measuring_files

    toy = [path for path in measuring_files({"toy"}) if path.name == "test_toy_quantizer.py"]
    assert len(toy) == 1 and toy[0] not in measuring_files({"srft"})
    assert code_version(frozenset({"toy"})) != code_version(frozenset())
