import json
import os

import pytest
import torch

from lockstep import contract, ops
from lockstep.model import (ModelConfig, Transformer, load_model, logprobs, pack, packed_logprobs,
                            positions_from_cu_seqlens, token_entropy)
from lockstep.model.transformer import ENTROPY_ROWS

from lockstep.harness.model_check import cached_logprobs

from _models import eager, saved_hf_model

FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe", "gemma3_text"]


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf"))


def _hf_logprobs(hf_model, seq):
    with torch.no_grad():
        logits = hf_model(seq[None]).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, seq[1:, None])[:, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_parity_with_transformers(family, dtype, hf_root):
    from transformers import AutoModelForCausalLM

    path = saved_hf_model(family, hf_root)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **eager(family)).eval()
    model = load_model(path, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 300, (n,), generator=gen) for n in (23, 70, 2)]
    ours = logprobs(model, seqs)
    worst = max(float((_hf_logprobs(hf, s) - lp.detach()).abs().max()) for s, lp in zip(seqs, ours))
    assert worst <= contract.chain_tolerance(dtype), worst
    # Logits: the contract has no logits number, so its "relative to PyTorch" criterion applies. Against
    # transformers in float64, lockstep's error may be at most 2x transformers' own at this dtype + 1 ulp.
    ids, cu = pack(seqs[:1])
    hf64 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, **eager(family)).eval()
    with torch.no_grad():
        ref = hf64(seqs[0][None]).logits[0]
        hf_err = float((hf(seqs[0][None]).logits[0].double() - ref).abs().max())
        our_err = float((model.logits(ids, cu).double() - ref).abs().max())
    factor, floor_ulps = contract.relative_to_pytorch()
    assert our_err <= factor * hf_err + floor_ulps * contract.ulp(dtype, float(ref.abs().max())), (our_err, hf_err)


@pytest.mark.parametrize("family", FAMILIES)
def test_save_is_read_by_transformers_and_load_model(family, tmp_path):
    from transformers import AutoModelForCausalLM

    model = Transformer.from_config(ModelConfig.tiny(family, vocab_size=300), seed=3)
    model.save(str(tmp_path))
    again = load_model(str(tmp_path), dtype=torch.float32)
    for (n, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), n
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, **eager(family))
    seq = torch.arange(1, 30)
    assert float((_hf_logprobs(hf, seq) - logprobs(model, [seq])[0].detach()).abs().max()) <= 1e-5


def test_sharded_checkpoint(tmp_path):
    from safetensors.torch import save_file

    model = Transformer.from_config(ModelConfig.tiny("llama"), seed=5)
    model.save(str(tmp_path / "single"))
    state = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    names = sorted(state)
    half = len(names) // 2
    folder = tmp_path / "sharded"
    folder.mkdir()
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(folder / file))
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text((tmp_path / "single" / "config.json").read_text())
    loaded = load_model(str(folder), dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), loaded.parameters()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_invariant_to_batch_order_padding_and_kv_cache(family, dtype):
    model = Transformer.from_config(ModelConfig.tiny(family), seed=1, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 512, (n,), generator=gen) for n in (45, 1 + 1, 70, 9)]
    alone = [logprobs(model, [s])[0] for s in seqs]
    packed = logprobs(model, seqs)
    reordered = logprobs(model, seqs[::-1])[::-1]
    padded = logprobs(model, [seqs[2], torch.zeros(33, dtype=torch.long), seqs[0]])
    for a, b, c in zip(alone, packed, reordered):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(padded[0], alone[2]) and torch.equal(padded[2], alone[0])
    for chunk in (1, 7, 16, 100):
        assert torch.equal(cached_logprobs(model, seqs[2], chunk), alone[2]), chunk


@pytest.mark.parametrize("family", FAMILIES)
def test_input_embedding_gradient_alone_equals_batched(family):
    model = Transformer.from_config(ModelConfig.tiny(family), seed=2)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 512, (n,), generator=gen) for n in (30, 12, 64)]

    def embed_grad(batch, which):
        ids, cu = pack(batch)
        emb = model.embed(ids).detach().requires_grad_()
        hidden = model(None, cu, inputs_embeds=emb)
        a, b = int(cu[which]), int(cu[which + 1])
        lp = ops.selected_logprobs(hidden[a:b - 1], model.lm_head_weight, ids[a + 1:b])
        lp.sum().backward()
        return emb.grad[a:b]

    alone = embed_grad([seqs[1]], 0)
    assert torch.equal(embed_grad(seqs, 1), alone)
    assert torch.equal(embed_grad([seqs[2], seqs[1], seqs[0]], 1), alone)


@pytest.mark.parametrize("family, cap", [("llama", None), ("gemma3_text", 2.0)])
def test_packed_logprobs_entropy_is_the_next_token_distributions_whatever_the_rows_around_it(family, cap):
    """entropy=True leaves the logprobs' bits as they are and adds each row's entropy at the temperature
    (Gemma's final-logit softcapping included): float64's within the logprob tolerance, and the same
    bits for a sequence alone as packed with others over more than ENTROPY_ROWS rows."""
    model = Transformer.from_config(ModelConfig.tiny(family, final_logit_softcapping=cap), seed=3)
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 512, (n,), generator=gen) for n in (ENTROPY_ROWS - 50, 90, 5)]
    lp, targets = packed_logprobs(model, seqs, 0.7)
    lp_e, targets_e, ent = packed_logprobs(model, seqs, 0.7, entropy=True)
    assert torch.equal(lp_e, lp) and torch.equal(targets_e, targets) and not ent.requires_grad
    assert ent.shape == lp.shape and ent.dtype == torch.float32
    assert torch.equal(packed_logprobs(model, seqs[1:2], 0.7, entropy=True)[2], ent[ENTROPY_ROWS - 51:ENTROPY_ROWS + 38])
    ids, cu = pack(seqs)
    with torch.no_grad():
        hidden = model(ids, cu)
        rows = torch.cat([torch.arange(int(a), int(b) - 1) for a, b in zip(cu[:-1], cu[1:])])
        logits = hidden[rows].double() @ model.lm_head_weight.double().T
        logits = logits if cap is None else cap * torch.tanh(logits / cap)
        truth = token_entropy(torch.log_softmax(logits / 0.7, -1))
    assert float((ent.double() - truth).abs().max()) <= contract.tolerance("vocab_logprobs", torch.float32).atol


def test_positions_from_cu_seqlens():
    assert positions_from_cu_seqlens(torch.tensor([0, 3, 3, 5])).tolist() == [0, 1, 2, 0, 1]


def test_every_family_list_names_the_same_families():
    from lockstep import cli
    from lockstep.integrations import hf
    from lockstep.model.config import FAMILIES as CONFIG_FAMILIES

    assert set(cli.FAMILIES) == set(hf.FAMILIES) == set(CONFIG_FAMILIES) == set(FAMILIES)


def test_unknown_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"unknown architecture model_type='gpt2'; supported: \['gemma3_text', 'llama', 'qwen2', 'qwen3', 'qwen3_moe'\]"):
        load_model(str(tmp_path))


def _saved(tmp_path):
    model = Transformer.from_config(ModelConfig.tiny("llama"), seed=0)
    model.save(str(tmp_path))
    from safetensors.torch import load_file
    return load_file(str(tmp_path / "model.safetensors"))


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop("model.layers.1.mlp.up_proj.weight"), r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"),
    (lambda s: s.__setitem__("model.layers.9.extra", torch.zeros(1)), r"unexpected tensors \['model.layers.9.extra'\]"),
    (lambda s: s.__setitem__("model.norm.weight", torch.ones(63)), r"model.norm.weight: expected \[64\], got \[63\]"),
])
def test_bad_checkpoints_are_refused(tmp_path, edit, message):
    from safetensors.torch import save_file

    state = _saved(tmp_path)
    edit(state)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        load_model(str(tmp_path))


def test_pickled_weights_are_never_loaded(tmp_path):
    _saved(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match="never unpickles"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("overrides, message", [
    (dict(num_kv_heads=3), "num_kv_heads: expected a divisor of num_heads=4"),
    (dict(hidden_size=0), "hidden_size: expected a positive int"),
    (dict(head_dim=15), "head_dim: expected an even number"),
    (dict(family="gpt2"), "family: unknown architecture 'gpt2'"),
])
def test_config_out_of_range(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**overrides)


def test_token_ids_beyond_vocabulary():
    model = Transformer.from_config(ModelConfig.tiny("llama", vocab_size=100))
    with pytest.raises(ValueError, match=r"input_ids: expected values in \[0, 100\), found 100"):
        logprobs(model, [[1, 2, 100]])
    with pytest.raises(ValueError, match="sequences: sequence 1 is empty"):
        logprobs(model, [[1, 2], []])


@pytest.mark.parametrize("family", FAMILIES)
def test_check_model_cli_on_a_checkpoint(family, hf_root, capsys):
    from lockstep import cli

    assert cli.main(["check-model", saved_hf_model(family, hf_root), "--dtype", "fp32,bf16"]) == 0
    out = capsys.readouterr().out
    assert "2 passed, 0 failed" in out


def test_check_model_reports_a_chain_failure(monkeypatch, capsys):
    """The float64 chain check can fail: a contract of zero tolerance is missed by bf16."""
    from lockstep import cli

    monkeypatch.setattr(contract, "chain_tolerance", lambda dtype: 0.0)
    assert cli.main(["check-model", "tiny", "--dtype", "bf16"]) == 1
    assert "0 passed, 1 failed" in capsys.readouterr().out


def _word_tokenizer_folder(path, vocab_size=300):
    """A model folder with a word-level tokenizer.json whose words are ids 0..n-1."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "the", "quick", "fox", "jumps", "over", "lazy", "dog", "."]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    model = Transformer.from_config(ModelConfig.tiny("llama", vocab_size=vocab_size), seed=1)
    model.save(str(path))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}))
    return path


def test_a_checkpoint_carries_the_tokenizer_of_its_model(tmp_path):
    from lockstep import cli

    source = _word_tokenizer_folder(tmp_path / "source")
    assert load_model(str(source)).tokenizer.encode("the quick fox") == [1, 2, 3]
    data = tmp_path / "d.txt"
    data.write_text("the quick fox jumps over the lazy dog . " * 200)
    out = tmp_path / "run"
    assert cli.main(["train", "--model", str(source), "--data", str(data), "--steps", "2", "--seq-len", "16",
                     "--micro-batch-tokens", "32", "--out", str(out)]) == 0
    checkpoint = out / (out / "latest").read_text()
    assert (checkpoint / "tokenizer.json").exists() and (checkpoint / "tokenizer_config.json").exists()
    assert load_model(str(checkpoint)).tokenizer.encode("the quick fox") == [1, 2, 3]


def test_a_folder_without_a_tokenizer_warns_once_when_text_is_encoded_as_bytes(tmp_path):
    import warnings

    Transformer.from_config(ModelConfig.tiny("llama", vocab_size=300)).save(str(tmp_path / "m"))
    model = load_model(str(tmp_path / "m"))
    with pytest.warns(UserWarning, match="has no tokenizer.json: text is encoded as UTF-8 bytes") as caught:
        assert len(model.tokenizer.encode("the quick fox")) == 14
        model.tokenizer.encode("again")
    assert len([w for w in caught if "tokenizer.json" in str(w.message)]) == 1
    # The built-in byte tokenizer of a tiny model is the model's own: its checkpoints say so, and no warning.
    from lockstep.model import ByteTokenizer, with_byte_tokenizer

    tiny = with_byte_tokenizer(Transformer.from_config(ModelConfig.tiny("llama", vocab_size=300)))
    assert isinstance(tiny.tokenizer, ByteTokenizer) and tiny.tokenizer.fallback_for is None
    tiny.save(str(tmp_path / "t"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_model(str(tmp_path / "t")).tokenizer.encode("text")


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_safetensors_file_is_named_in_one_clear_error(tmp_path, damage):
    Transformer.from_config(ModelConfig.tiny("llama", vocab_size=300)).save(str(tmp_path))
    weights = tmp_path / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(raw[: len(raw) // 2] if damage == "truncated" else b"\x00garbage" * 100)
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file .*damaged or truncated"):
        load_model(str(tmp_path))


def test_logprobs_refuses_sequences_beyond_the_context_and_float_ids():
    model = Transformer.from_config(ModelConfig.tiny("llama", max_position_embeddings=256))
    with pytest.raises(ValueError, match="sequence 0 has 300 tokens .* beyond the model's context of 256"):
        logprobs(model, [list(range(300))])
    with pytest.raises(TypeError, match="sequence 1 holds torch.float32 values; expected integer token ids"):
        logprobs(model, [[1, 2], [1.7, 2.0]])
    assert logprobs(model, [list(range(256))])[0].shape == (255,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gemma_final_logit_softcapping_matches_transformers_and_keeps_invariance(dtype, tmp_path):
    from transformers import AutoModelForCausalLM

    model = Transformer.from_config(ModelConfig.tiny("gemma3_text", vocab_size=300, final_logit_softcapping=0.5),
                                    seed=6, dtype=torch.float32)
    model.save(str(tmp_path))
    ours = load_model(str(tmp_path), dtype=dtype)
    assert ours.config.final_logit_softcapping == 0.5
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=dtype, **eager("gemma3_text")).eval()
    seq = torch.arange(1, 40) * 7 % 300
    lp = logprobs(ours, [seq])[0].detach()
    assert float((_hf_logprobs(hf, seq) - lp).abs().max()) <= contract.chain_tolerance(dtype)
    with torch.no_grad():
        ids, cu = pack([seq])
        assert float(ours.logits(ids, cu).float().abs().max()) <= 0.5
    plain = Transformer.from_config(ModelConfig.tiny("gemma3_text", vocab_size=300), seed=6, dtype=dtype)
    assert float((logprobs(plain, [seq])[0].detach() - lp).abs().max()) > 1e-2, "the cap must matter"
    other = [torch.arange(3, 20), seq, torch.arange(50, 61)]
    assert torch.equal(logprobs(ours, other)[1], lp)
    assert torch.equal(cached_logprobs(ours, seq, 7), lp)


def test_with_byte_tokenizer_gives_bytes_only_to_a_model_without_one(tmp_path):
    import re
    import warnings

    from lockstep.model import ByteTokenizer, with_byte_tokenizer

    tiny = Transformer.from_config(ModelConfig.tiny("llama", vocab_size=300))
    assert with_byte_tokenizer(tiny) is tiny and isinstance(tiny.tokenizer, ByteTokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # the tiny model's own tokenizer: silent
        assert tiny.tokenizer.encode("hi") == [256, 104, 105]
    model = load_model(str(_word_tokenizer_folder(tmp_path / "source")))
    own = model.tokenizer
    assert with_byte_tokenizer(model) is model and model.tokenizer is own
    # A folder without tokenizer.json keeps its stand-in, which says what it does on its first string.
    tiny.tokenizer = None
    tiny.save(str(tmp_path / "bare"))
    bare = load_model(str(tmp_path / "bare"))
    stand_in = bare.tokenizer
    assert with_byte_tokenizer(bare).tokenizer is stand_in
    text = (f"{tmp_path / 'bare'} has no tokenizer.json: text is encoded as UTF-8 bytes (ids 0-255), not with the "
            "model's own tokenizer; pass token ids, or add the tokenizer files")
    with pytest.warns(UserWarning, match=f"^{re.escape(text)}$"):
        assert bare.tokenizer.encode("hi") == [256, 104, 105]


@pytest.mark.parametrize("family", ["qwen2", "gemma3_text"])
def test_the_projections_of_one_input_in_one_call_keep_the_bits_and_the_hooks(family, monkeypatch):
    """Without a gradient (the engine's steps), q, k and v, and gate and up, go through one
    ops.linears call each, and each residual add with its norm through ops.add_rms_norm: the hidden
    states keep the bits of the trainer's forward, and a module with a forward hook or a forward of
    its own is still called, hook and all, with its output as before."""
    model = Transformer.from_config(ModelConfig.tiny(family, vocab_size=300), seed=4, dtype=torch.bfloat16)
    ids, cu = pack([[5, 9, 2, 7, 1], [3, 3, 8]])
    trained = model(ids, cu).detach()                    # a gradient is recorded: a call per layer
    grouped = []
    original = ops.linears
    monkeypatch.setattr(ops, "linears", lambda *a, **k: grouped.append(1) or original(*a, **k))
    with torch.no_grad():
        assert torch.equal(model(ids, cu).view(torch.int16), trained.view(torch.int16))
        assert len(grouped) == 2 * model.config.num_layers
        seen = []
        model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
        assert torch.equal(model(ids, cu).view(torch.int16), trained.view(torch.int16))
    assert seen == [(8, model.config.num_kv_heads * model.config.head_dim)]
    assert len(grouped) == 4 * model.config.num_layers - 1      # all but layer 0's attention
    # An instance's own forward (an offloading wrapper, say) and a hooked layer are called too.
    up = model.model.layers[1].mlp.up_proj
    up.forward = lambda x, call=up.forward: seen.append("up") or call(x)
    model.model.layers[1].register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    seen.clear()
    with torch.no_grad():
        assert torch.equal(model(ids, cu).view(torch.int16), trained.view(torch.int16))
    assert seen == [(8, model.config.num_kv_heads * model.config.head_dim), "up", (8, model.config.hidden_size)]
