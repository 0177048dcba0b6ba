import pytest
import torch
from conftest import loaded, requires_models, run_kvq

from kvq.apply import QuantizerBank, kv_geometry
from kvq.calibrate import CalibrationConfig, calibrate, load_learned, read_artifact, save_artifact
from kvq.capture import capture_kv
from kvq.data import token_windows
from kvq.errors import KvqError
from kvq.learned import Cayley, Householder, learnable_modules, parameters_per_site
from kvq.quant import QuantSpec


@pytest.mark.parametrize("module", [Cayley(3, 32), Householder(3, 32, 16)])
def test_learned_rotation_stays_orthogonal_while_training(module):
    optimizer = torch.optim.Adam(module.parameters(), lr=0.05)
    target = torch.linalg.qr(torch.randn(32, 32))[0]
    for _ in range(25):
        optimizer.zero_grad()
        ((module() - target) ** 2).sum().backward()
        optimizer.step()
    r = module().detach().double()
    eye = torch.eye(32, dtype=torch.float64).expand(3, 32, 32)
    assert torch.allclose(r.transpose(-1, -2) @ r, eye, atol=1e-5)
    assert not torch.allclose(r, eye, atol=1e-2)  # it did move


def test_rotations_start_near_identity():
    for module in (Cayley(2, 16), Householder(2, 16, 8)):
        assert torch.allclose(module(), torch.eye(16).expand(2, 16, 16), atol=1e-2)


@pytest.mark.parametrize("d,k", [(64, 32), (64, 8), (256, 128)])
def test_householder_parameter_count_matches_table_3(d, k):
    assert parameters_per_site(learnable_modules("householder", 5, d, k, 0)) == (k + 1) * d
    assert parameters_per_site(learnable_modules("cayley", 5, d, None, 0)) == d * d + d
    assert parameters_per_site(learnable_modules("lambda", 5, d, None, 0)) == d


@pytest.fixture(scope="module")
def smollm2_capture():
    lm = loaded("smollm2-135m")
    windows = token_windows(lm.tokenizer, "shakespeare", 128, 2, split="calib")
    return lm, capture_kv(lm.model, windows, "hook", max_vectors=256)


@requires_models
@pytest.mark.parametrize("learn", ["lambda", "householder", "closed_form"])
def test_calibration_lowers_mse_on_real_activations(smollm2_capture, learn):
    lm, captured = smollm2_capture
    subset = {k: v for k, v in captured.items() if k[0] < 4}
    results = calibrate(subset, kv_geometry(lm.model.config), CalibrationConfig("smollm2-135m", learn=learn, steps=40))
    before = sum(r.mse_before for r in results.values())
    after = sum(r.mse_after for r in results.values())
    assert after < before


@requires_models
def test_artifact_round_trip_reproduces_training_mse(smollm2_capture, tmp_path):
    """The quantizer a sweep builds from the artifact must see what calibration trained."""
    lm, captured = smollm2_capture
    geometry = kv_geometry(lm.model.config)
    cfg = CalibrationConfig("smollm2-135m", base="srft", learn="cayley", steps=20, seed=4)
    results = calibrate(captured, geometry, cfg)
    path = tmp_path / "cal.pt"
    save_artifact(path, cfg, geometry, results, {"commit": None})
    assert read_artifact(path)["meta"]["learn"] == "cayley"
    spec = QuantSpec("srft", 4, calibration=str(path))
    bank = QuantizerBank(spec, geometry, load_learned(path, "smollm2-135m", geometry, spec))
    for key in [(0, "k"), (17, "v")]:
        x = captured[key]
        mse = float(((bank.get(*key)(x) - x) ** 2).mean())
        assert mse == pytest.approx(results[key].mse_after, rel=1e-3)
        assert torch.equal(bank.get(*key).lam, results[key].learned.lam)


@requires_models
def test_wrong_model_artifact_is_one_line_error(smollm2_capture, tmp_path):
    lm, captured = smollm2_capture
    geometry = kv_geometry(lm.model.config)
    cfg = CalibrationConfig("qwen2.5-coder-0.5b", learn="lambda", steps=1)
    path = tmp_path / "qwen.pt"
    save_artifact(path, cfg, geometry, calibrate({(0, "k"): captured[(0, "k")]}, geometry, cfg), {})
    with pytest.raises(KvqError, match=r"made for model 'qwen2\.5-coder-0\.5b'"):
        load_learned(path, "smollm2-135m", geometry, QuantSpec("srft"))
    done = run_kvq("ppl", "--calibration", str(path), "--n-windows", "1")
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "made for model" in done.stderr
    with pytest.raises(KvqError, match="base 'srft'"):
        load_learned(path, "qwen2.5-coder-0.5b", geometry, QuantSpec("srht"))


def test_calibration_runs_on_the_given_device_and_returns_cpu_tensors():
    from kvq.apply import KVGeometry

    captured = {(0, "k"): torch.randn(64, 16), (0, "v"): torch.randn(64, 16)}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = calibrate(captured, KVGeometry(1, 1, 16), CalibrationConfig("m", learn="cayley", steps=3), device=device)
    assert all(r.learned.rotation.device.type == "cpu" for r in results.values())
