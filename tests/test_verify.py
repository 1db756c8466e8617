import pytest
import torch

from lockstep import cli
from lockstep.tools import verify
from lockstep.model import ModelConfig, Transformer

from _models import saved_hf_model

FEW = (verify.SETTINGS[0], verify.SETTINGS[1], verify.SETTINGS[3], verify.SETTINGS[5], verify.SETTINGS[7],
       verify.SETTINGS[9])


def _tiny(dtype):
    return Transformer.from_config(ModelConfig.tiny("llama"), seed=0, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_verify_is_exact_on_the_tiny_model(dtype):
    report = verify.run(_tiny, [dtype], max_new_tokens=6, settings=FEW, with_eager=False, log=lambda s: None)
    assert report.passed
    rows = [r for r in report.rows if r["path"] == "lockstep"]
    assert len(rows) == 2 and all(r["tokens"] > 0 and r["max_abs_dlogp"] == 0 for r in rows)
    assert report.backward_chain[str(dtype).removeprefix("torch.")]


def test_verify_fails_when_engine_logprobs_drift(monkeypatch):
    """The gate can fail: a one-ulp drift in what the engine reports is caught."""
    import lockstep.engine.model_runner as engine_mod

    real = engine_mod.sample

    def drifting(*args, **kwargs):
        draws = real(*args, **kwargs)
        for d in draws:
            d.logprob = float(torch.nextafter(torch.tensor(d.logprob), torch.tensor(-1e9)))
        return draws

    monkeypatch.setattr(engine_mod, "sample", drifting)
    report = verify.run(_tiny, [torch.float32], max_new_tokens=3, settings=FEW[:2], with_eager=False,
                        log=lambda s: None)
    assert not report.passed
    assert report.rows[0]["max_abs_dlogp"] > 0


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "gemma3_text"])
def test_verify_cli_on_a_transformers_checkpoint(family, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(verify, "SETTINGS", FEW)
    path = saved_hf_model(family, str(tmp_path))
    json_path = tmp_path / "verify.json"
    assert cli.main(["verify", path, "--dtype", "fp32,bf16", "--max-new-tokens", "4", "--json", str(json_path)]) == 0
    out = capsys.readouterr().out
    assert "0 / 0 / 0 and identical tokens" in out and "eager PyTorch" in out
    assert json_path.exists()


def test_verify_writes_its_json_into_a_folder_it_creates(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(verify, "SETTINGS", FEW[:1])
    json_path = tmp_path / "missing" / "deeper" / "verify.json"
    assert cli.main(["verify", "tiny", "--dtype", "fp32", "--max-new-tokens", "2", "--no-eager", "--json",
                     str(json_path)]) == 0
    out = capsys.readouterr().out
    assert "0 / 0 / 0 and identical tokens" in out and json_path.exists()


@pytest.mark.parametrize("command", ["verify", "check-model"])
def test_an_unknown_family_is_one_clear_line(command, capsys):
    argv = [command, "tiny", "--family", "mistral"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--family: invalid choice: 'mistral'" in err and "Traceback" not in err


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_verify_names_a_damaged_checkpoint(tmp_path, capsys, damage):
    Transformer.from_config(ModelConfig.tiny("llama")).save(str(tmp_path))
    weights = tmp_path / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(raw[: len(raw) // 3] if damage == "truncated" else b"\x7fELF" + b"\x00" * 64)
    assert cli.main(["verify", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert str(weights) in err and "not a readable safetensors file" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
