"""The batch experiment on the real weights (SmolLM2-135M-Instruct), kept small: a chat prompt
decoded greedily alone and in batches by stock transformers, by transformers under
batch_invariant() and by lockstep's Engine; and stock's sampler-vs-trainer logprob mismatch."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lockstep.tools import batch_experiment as be
from lockstep import cli
from lockstep.model import model_from_source


@pytest.fixture(scope="module")
def smol():
    return model_from_source("smollm2", torch.bfloat16)


def test_chat_prompts_are_the_chat_template_of_the_model(smol):
    prompts = be.chat_prompts(smol)
    assert len(prompts) == len(be.QUESTIONS)
    text = smol.tokenizer.decode(prompts[1])
    assert "What is the capital of France?" in text and "assistant" in text


def test_batch_of_places_the_prompt_under_test():
    prompts = [[0], [1], [2], [3], [4]]
    assert be.batch_of(prompts, 1, 0) == [[0]]
    assert be.batch_of(prompts, 4, 3) == [[1], [2], [3], [0]]
    assert be.batch_of(prompts, 3, 1) == [[1], [0], [2]]


def test_the_experiment_on_the_real_model(smol, monkeypatch):
    monkeypatch.setattr(be, "PLACEMENTS", ((1, 0), (4, 3)))
    monkeypatch.setattr(be, "ENGINE_SETTINGS", be.ENGINE_SETTINGS[:1] + be.ENGINE_SETTINGS[2:4])
    lines = []
    report = be.run(lambda dtype: smol, torch.bfloat16, max_new_tokens=6, mismatch_dtypes=(torch.bfloat16,),
                    log=lines.append)
    paths = {p["path"]: p for p in report.paths}
    assert set(paths) == {"stock transformers", "transformers + batch_invariant()", "lockstep Engine"}
    # lockstep's two ways are batch-invariant: one completion however the prompt is batched
    assert paths["lockstep Engine"]["unique"] == 1 and paths["lockstep Engine"]["runs"] == 4
    assert paths["transformers + batch_invariant()"]["unique"] == 1
    # the text a person reads is a real answer, not token ids
    (text,) = paths["lockstep Engine"]["completions"]
    assert any(c.isalpha() for c in text)
    (row,) = report.stock_logprob_mismatch
    assert row["dtype"] == "bfloat16" and row["tokens"] > 0 and math.isfinite(row["max_abs_dlogp"])
    assert any("stock transformers: sampler logprobs vs a training forward" in line for line in lines)


def test_summary_never_claims_a_difference_it_did_not_measure():
    one = be.ExperimentReport("bfloat16", 4, "q", paths=[{"path": "stock transformers", "unique": 1, "runs": 6,
                                                          "completions": {"a": 6}}])
    assert "gave one completion at every placement" in be.summary_lines(one)[-1]
    two = be.ExperimentReport("bfloat16", 4, "q", paths=[{"path": "stock transformers", "unique": 2, "runs": 6,
                                                          "completions": {"a": 5, "b": 1}}])
    assert not any("gave one completion" in line for line in be.summary_lines(two))
    assert "stock transformers: 2 unique completion(s) in 6 runs" in be.summary_lines(two)


def test_verify_defaults_to_the_real_model():
    args = cli.build_parser().parse_args(["verify"])
    assert args.model == "smollm2"
    assert cli.build_parser().parse_args(["serve"]).model == "smollm2"


def test_verify_cli_on_the_real_model_writes_model_config_gate_and_experiment(tmp_path, capsys, monkeypatch):
    from lockstep.tools import verify

    monkeypatch.setattr(verify, "SETTINGS", verify.SETTINGS[:2])
    monkeypatch.setattr(be, "PLACEMENTS", ((1, 0), (3, 1)))
    monkeypatch.setattr(be, "ENGINE_SETTINGS", be.ENGINE_SETTINGS[:1])
    out = tmp_path / "verify.json"
    assert cli.main(["verify", "--max-new-tokens", "3", "--experiment-tokens", "4", "--no-eager",
                     "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "smollm2 (SmolLM2-135M-Instruct, GGUF Q4_1)" in printed
    assert "0 / 0 / 0 and identical tokens" in printed and "The batch experiment" in printed
    data = json.loads(out.read_text())
    assert data["model"] == "smollm2" and data["config"]["num_hidden_layers"] == 30
    assert data["verify"]["passed"] and data["experiment"]["paths"][2]["unique"] == 1
