"""Per-site policies (K vs V, boundary layers kept exact) and the KL metrics beside PPL."""

import json

import pytest
import torch
from conftest import requires_models, run_kvq
from transformers import LlamaConfig, LlamaForCausalLM

from kvq.apply import KVGeometry, QuantizerBank
from kvq.errors import KvqError
from kvq.policy import parse_policy
from kvq.ppl import perplexity
from kvq.quant import QuantSpec
from kvq.quant.exact import Exact
from kvq.sweep_spec import expand, load_sweep

LAYERS, HEADS, D = 6, 2, 64
K8_V4_BOUNDARY = {"k": {"bits": 8}, "v": {"bits": 4},
                  "layers": [{"first": 1, "use": "fp"}, {"last": 1, "use": "fp"},
                             {"layers": ["2-3"], "v": {"granularity": "per_channel_group", "group_size": 16}}]}


def bank(policy: dict | None) -> QuantizerBank:
    return QuantizerBank(QuantSpec("int", 4), KVGeometry(LAYERS, HEADS, D), policy=parse_policy(policy))


def test_a_policy_builds_the_expected_quantizer_at_every_site():
    sites = bank(K8_V4_BOUNDARY)
    for role in ("k", "v"):
        for layer in (0, LAYERS - 1):
            assert isinstance(sites.get(layer, role), Exact)
    for layer in range(1, LAYERS - 1):
        keys, values = sites.get(layer, "k"), sites.get(layer, "v")
        assert keys.inner.bits == 8 and keys.inner.granularity == "per_token"
        assert values.inner.bits == 4
        assert values.inner.granularity == ("per_channel_group" if layer in (2, 3) else "per_token")
        assert values.inner.group_size == (16 if layer in (2, 3) else 32)
    x = torch.randn(1, HEADS, 10, D)
    exact = sites.get(0, "k")
    assert exact(x) is x  # an fp site hands back what it was given: nothing quantized


def test_mixed_policy_bits_equal_a_hand_count():
    sites = bank(K8_V4_BOUNDARY)
    tokens = 32
    for layer in range(LAYERS):
        for role in ("k", "v"):
            sites.get(layer, role)(torch.randn(1, HEADS, tokens, D))
    # int-b per token: b bits per element and one float32 scale per row of D; per channel group: a float32
    # scale per 16 elements of a row, and one per channel over the call's tokens
    exact = 2 * 2 * 16.0  # layers 0 and 5, K and V
    keys = 4 * (8 + 32 / D)
    values = 2 * (4 + 32 / D) + 2 * (4 + 32 / 16 + 32 / tokens)
    assert sites.measured_bits_per_element() == pytest.approx((exact + keys + values) / (2 * LAYERS), rel=1e-12)
    assert sites.bits_per_element(tokens) == pytest.approx(sites.measured_bits_per_element(), rel=1e-12)


def test_rules_that_disagree_on_a_layer_or_leave_the_model_are_errors():
    with pytest.raises(KvqError, match=r"\{first: 2\} and \{layers: \[1\]\} disagree on layer 1"):
        bank({"layers": [{"first": 2, "use": "fp"}, {"layers": [1], "k": {"bits": 8}}]})
    with pytest.raises(KvqError, match=r"disagree on k.bits of layer 3 \(8 vs 6\)"):
        bank({"layers": [{"layers": ["2-3"], "k": {"bits": 8}}, {"last": 3, "k": {"bits": 6}}]})
    with pytest.raises(KvqError, match="6 is out of range for a model of 6 layers"):
        bank({"layers": [{"layers": [6], "use": "fp"}]})
    # rules that agree may overlap, in any order
    same = bank({"layers": [{"first": 2, "use": "fp"}, {"layers": [1], "use": "fp"}]})
    assert isinstance(same.get(1, "v"), Exact) and not isinstance(same.get(2, "v"), Exact)


def tiny_model():
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=128,
                         head_dim=32, intermediate_size=64, vocab_size=97)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("mode", ["hook", "cache"])
def test_kl_is_zero_against_itself_and_positive_for_two_bits(mode):
    model = tiny_model()
    windows = torch.randint(0, 97, (4, 33), generator=torch.Generator().manual_seed(1))
    reference = []
    fp = perplexity(model, windows, None, mode, 2, keep_log_probs=reference)
    itself = perplexity(model, windows, None, mode, 2, reference=reference).divergence
    assert itself.kld == 0 and itself.max_window_kld == 0 and itself.top1_agreement == 1
    geometry = KVGeometry(2, 2, 32)
    two_bits = perplexity(model, windows, QuantizerBank(QuantSpec("int", 2), geometry), mode, 2,
                          reference=reference)
    assert two_bits.divergence.kld > 1e-4 and two_bits.divergence.top1_agreement < 1
    assert two_bits.divergence.max_window_kld == max(two_bits.divergence.window_kld)
    assert two_bits.ppl != fp.ppl


def test_sweeps_grid_over_policies_and_keep_the_ids_of_default_cells(tmp_path):
    base = ("name: p\nmodels: [smollm2-135m]\ndata: {seq_len: 32, n_windows: 1}\nmode: cache\n"
            "grid:\n  quantizer: [int]\n")
    plain = tmp_path / "plain.yaml"
    plain.write_text(base)
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text(base + "metrics: [ppl]\npolicy: [{}, {k: {bits: 8}}, {layers: [{first: 1, use: fp}]}]\n")
    plain_cells, mixed_cells = expand(load_sweep(plain)), expand(load_sweep(mixed))
    assert len(mixed_cells) == 3 * len(plain_cells)
    assert [c.id for c in mixed_cells[:len(plain_cells)]] == [c.id for c in plain_cells]
    assert len({c.id for c in mixed_cells}) == len(mixed_cells)
    assert mixed_cells[1].config()["policy"] == {"k": {"bits": 8}}
    kld = tmp_path / "kld.yaml"
    kld.write_text(base + "metrics: [ppl, kld]\n")
    assert expand(load_sweep(kld))[0].id != plain_cells[0].id  # a cell measured without KL cannot stand in


@requires_models
def test_a_policy_sweep_with_kl_metrics_records_and_reports_them(tmp_path):
    spec = tmp_path / "boundary.yaml"
    spec.write_text("name: boundary\nmodels: [smollm2-135m]\ndata: {seq_len: 32, n_windows: 2}\nmode: cache\n"
                    "grid:\n  quantizer: [int]\n  bits: [2]\nmetrics: [ppl, kld]\n"
                    "policy: [{}, {layers: [{first: 30, use: fp}]}]\n")
    runs, ledger = tmp_path / "runs", tmp_path / "RESULTS.md"
    done = run_kvq("sweep", str(spec), "--runs-dir", str(runs), "--results", str(ledger))
    assert done.returncode == 0, done.stderr
    records = [json.loads(p.read_text()) for p in sorted((runs / "boundary").glob("*.json"))
               if json.loads(p.read_text()).get("cell_id")]
    by_policy = {json.dumps(r["config"].get("policy")): r for r in records}
    all_fp = by_policy[json.dumps({"layers": [{"first": 30, "use": "fp"}]})]
    quantized = by_policy["null"]
    assert all_fp["metrics"]["divergence"]["kld"] == 0 and all_fp["metrics"]["dppl"] == 0
    assert all_fp["bits_per_element"] == 16
    assert quantized["metrics"]["divergence"]["kld"] > 0
    assert "KL(fp\\|\\|q) mean ± std" in ledger.read_text()  # its pipes escaped: the header stays one cell
    assert (runs / "boundary" / "figures" / "kld_vs_bits.png").exists()
