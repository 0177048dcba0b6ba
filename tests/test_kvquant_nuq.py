"""KVQuant's nuq datatype (kvq.quant.nuq): weighted k-means on scalars, the Fisher information at k_proj's and
v_proj's outputs against autograd, the artifact `datatype: nuq` reads, and the cells that read one."""

import json

import pytest
import torch
from conftest import assert_one_error_line, requires_models, run_kvq_in_one_process
from transformers import LlamaConfig, LlamaForCausalLM

from kvq.data import DataSpec
from kvq.errors import KvqError
from kvq.quant import QuantSpec, Site, build_quantizer
from kvq.quant.kvquant import KVQuant, nf_signposts
from kvq.quant.nuq import NUQ_FORMAT, fisher_activations, fit_signposts, weighted_error, weighted_kmeans
from kvq.records import RecordBook
from kvq.sweep_spec import Cell

SMALL = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=128, head_dim=32,
             intermediate_size=64, vocab_size=101, max_position_embeddings=256)


def tiny_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMALL)).eval()


def write_artifact(path, signposts: dict, bits=3, outliers=0.01, head_dim=64, n_layers=2):
    meta = {"model": "tiny", "bits": bits, "outliers": outliers, "head_dim": head_dim, "n_layers": n_layers}
    path.write_text(json.dumps({"format": NUQ_FORMAT, "meta": meta, "signposts": signposts}))
    return str(path)


def test_kmeans_finds_the_centres_of_separated_clusters():
    centres = torch.tensor([-0.9, -0.6, -0.3, -0.05, 0.1, 0.35, 0.6, 0.95], dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    points = (centres.repeat_interleave(500) + 0.01 * torch.randn(4000, generator=generator, dtype=torch.float64))
    fitted = weighted_kmeans(points, torch.ones_like(points), torch.tensor(nf_signposts(3)))
    means = points.view(8, 500).mean(-1)  # each cluster's own mean: where Lloyd's stops
    torch.testing.assert_close(fitted, means, atol=1e-12, rtol=0)


def test_points_of_zero_weight_do_not_move_the_signposts():
    generator = torch.Generator().manual_seed(1)
    kept, ignored = torch.rand(3000, generator=generator) * 2 - 1, torch.rand(3000, generator=generator) * 0.2 + 0.8
    weights = torch.rand(3000, generator=generator)
    start = torch.tensor(nf_signposts(3))
    alone = weighted_kmeans(kept, weights, start)
    together = weighted_kmeans(torch.cat([kept, ignored]), torch.cat([weights, torch.zeros(3000)]), start)
    torch.testing.assert_close(together, alone, atol=1e-12, rtol=0)


def test_fitting_lowers_the_weighted_error_it_is_weighted_by():
    generator = torch.Generator().manual_seed(2)
    points = (torch.randn(20_000, generator=generator) ** 3).clamp(-4, 4) / 4  # heavy-tailed, in [-1, 1]
    uniform = torch.ones_like(points)
    heavy = torch.where(points > 0.5, 100.0, 1.0) * torch.rand(points.shape, generator=generator)
    start = torch.tensor(nf_signposts(3))
    flat, pulled = weighted_kmeans(points, uniform, start), weighted_kmeans(points, heavy, start)
    assert weighted_error(points, uniform, flat) < weighted_error(points, uniform, start)
    assert weighted_error(points, heavy, pulled) < weighted_error(points, heavy, flat)
    assert weighted_error(points, uniform, flat) < weighted_error(points, uniform, pulled)


def test_fisher_is_the_squared_gradient_of_the_loss_at_each_projection_output():
    """Checked against autograd through an independent path: a zero tensor added to one layer's k_proj / v_proj
    output whose gradient the loss gives directly."""
    model = tiny_llama()
    windows = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(3))
    found = fisher_activations(model, windows, SMALL["head_dim"])
    assert set(found) == {(layer, role) for layer in range(2) for role in "kv"}
    assert all(p.requires_grad and p.grad is None for p in model.parameters())
    for layer, role in [(0, "k"), (1, "v")]:
        projection = getattr(model.model.layers[layer].self_attn, f"{role}_proj")
        for index in range(2):
            window = windows[index:index + 1]
            delta = torch.zeros(1, 24, SMALL["num_key_value_heads"] * SMALL["head_dim"], requires_grad=True)
            seen = {}

            def add_delta(_module, _inputs, output, seen=seen, delta=delta):
                seen["output"] = output.detach()
                return output + delta

            handle = projection.register_forward_hook(add_delta)
            model(input_ids=window, labels=window, use_cache=False).loss.backward()
            handle.remove()
            model.zero_grad(set_to_none=True)

            def heads(t):
                return t.view(1, 24, SMALL["num_key_value_heads"], SMALL["head_dim"]).transpose(1, 2)

            acts, fisher = found[(layer, role)]
            torch.testing.assert_close(acts[index:index + 1], heads(seen["output"]))
            torch.testing.assert_close(fisher[index:index + 1], heads(delta.grad) ** 2, rtol=1e-5, atol=1e-12)


def test_fitted_signposts_lower_the_fisher_weighted_error_of_the_normalised_keys():
    model = tiny_llama()
    windows = torch.randint(0, SMALL["vocab_size"], (4, 64), generator=torch.Generator().manual_seed(4))
    acts, fisher = fisher_activations(model, windows, SMALL["head_dim"])[(0, "k")]
    quantizer = KVQuant("k", 3, outliers=0.01)
    fitted = fit_signposts(quantizer, acts, fisher)
    scaled, mask, _, _ = quantizer.normalized(quantizer.vectors(acts))
    weights = quantizer.vectors(fisher)
    before = weighted_error(scaled[~mask], weights[~mask], quantizer.signposts)
    assert weighted_error(scaled[~mask], weights[~mask], fitted) < before
    assert fitted.min() >= -1 and fitted.max() <= 1 and len(fitted) == 8


@pytest.mark.parametrize("role", ["k", "v"])
def test_nuq_with_nf_signposts_is_nf_bit_for_bit_and_reads_its_sites_own(tmp_path, role):
    nf = list(nf_signposts(3))
    moved = [p * 0.5 for p in nf]
    path = write_artifact(tmp_path / "nuq.json", {"0.k": nf, "0.v": nf, "1.k": moved, "1.v": moved})
    x = torch.randn(2, 2, 40, 64, generator=torch.Generator().manual_seed(5))
    spec = QuantSpec("kvquant", 3, options={"datatype": "nuq", "signposts": path})
    reference = KVQuant(role, 3, "nf", 0.01)
    as_nf = build_quantizer(spec, Site(0, role, 64))
    assert torch.equal(as_nf.decode(as_nf.encode(x)), reference.decode(reference.encode(x)))
    halved = build_quantizer(spec, Site(1, role, 64))
    assert halved.signposts.tolist() == pytest.approx(moved)
    assert not torch.equal(halved.decode(halved.encode(x)), reference.decode(reference.encode(x)))


@pytest.mark.parametrize("options, site, message", [
    ({"datatype": "nuq"}, Site(0, "k", 64), "needs"),
    ({"signposts": "ARTIFACT"}, Site(0, "k", 64), "needs"),
    ({"datatype": "nuq", "signposts": "ARTIFACT", "outliers": 0.0}, Site(0, "k", 64), "outliers 0.01"),
    ({"datatype": "nuq", "signposts": "ARTIFACT"}, Site(0, "k", 128), "head_dim 64"),
    ({"datatype": "nuq", "signposts": "ARTIFACT"}, Site(2, "k", 64), "no layer 2"),
    ({"datatype": "nuq", "signposts": "MISSING"}, Site(0, "k", 64), "cannot read"),
    ({"datatype": "nuq", "signposts": "OTHER"}, Site(0, "k", 64), "not a `kvq calibrate --learn nuq` artifact"),
])
def test_a_wrong_artifact_is_refused_naming_the_option(tmp_path, options, site, message):
    nf = list(nf_signposts(3))
    paths = {"ARTIFACT": write_artifact(tmp_path / "nuq.json", {f"{i}.{r}": nf for i in range(2) for r in "kv"}),
             "MISSING": str(tmp_path / "absent.json"), "OTHER": str(tmp_path / "other.json")}
    (tmp_path / "other.json").write_text("{}")
    options = {key: paths.get(value, value) for key, value in options.items()}
    with pytest.raises(KvqError, match="kvquant option 'signposts'") as error:
        build_quantizer(QuantSpec("kvquant", 3, options=options), site)
    assert message in str(error.value)


def test_a_cell_reading_an_artifact_goes_stale_when_its_bytes_change(tmp_path):
    nf = list(nf_signposts(3))
    path = write_artifact(tmp_path / "nuq.json", {"0.k": nf})
    cell = Cell("smollm2-135m", "hook", DataSpec(), QuantSpec("kvquant", 3, options={"datatype": "nuq",
                                                                                      "signposts": path}))
    book = RecordBook(tmp_path / "runs", "cpu")
    before = book.context(cell)
    write_artifact(tmp_path / "nuq.json", {"0.k": [p / 2 for p in nf]})
    assert book.context(cell)["options.signposts"] != before["options.signposts"]


@requires_models
def test_kvq_calibrate_fits_an_artifact_kvq_ppl_reads(tmp_path):
    artifact = tmp_path / "smollm2-nuq3.json"
    fitted, measured, unfitted = run_kvq_in_one_process([
        (tmp_path, ["calibrate", "--model", "smollm2-135m", "--learn", "nuq", "--bits", "3", "--n-windows", "1",
                    "--seq-len", "64", "--out", str(artifact)]),
        (tmp_path, ["ppl", "--model", "smollm2-135m", "--quant", "kvquant", "--bits", "3", "--option",
                    "datatype=nuq", "--option", f"signposts={artifact}", "--seq-len", "64", "--n-windows", "1"]),
        (tmp_path, ["ppl", "--model", "smollm2-135m", "--quant", "kvquant", "--bits", "3", "--option",
                    "datatype=nuq"]),
    ])
    assert fitted["code"] == 0, fitted["stderr"]
    written = json.loads(artifact.read_text())
    assert written["meta"]["n_layers"] == 30 and len(written["signposts"]) == 60
    assert all(len(posts) == 8 and posts == sorted(posts) for posts in written["signposts"].values())
    assert measured["code"] == 0 and "dPPL" in measured["stdout"], measured["stderr"]
    assert_one_error_line(unfitted, "kvquant option 'signposts'")
