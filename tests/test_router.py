"""`lockstep serve` behind SGLang's own router (sglang-router, the `router` extra): two servers of a
tiny random Llama read from a GGUF file, the real router launched in front of them, real HTTP over
127.0.0.1, httpx and OpenAI's client.

Every answer through the router is checked against the same request sent to one server directly:
the same token ids and logprobs, bit for bit. The router must run here: without it, these tests fail
rather than skip."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import torch

import lockstep
from lockstep.model import ModelConfig, Transformer, convert_gguf, load_model
from lockstep.model.gguf import _LAYER_NAMES, _TOP_NAMES, permute_rope
from lockstep.server import build_server
from test_server import running

ROUTER_VERSION = "0.3.2"

CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
SPECIAL = ["<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: the character that stands for each byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tiny_gguf(path: str, seed: int) -> Transformer:
    """Write a tiny random Llama (weights from `seed`) as a GGUF file with a byte-level tokenizer and
    a chat template, with llama.cpp's own writer; returns the model written."""
    import gguf as gguf_ref

    tokens = _byte_alphabet() + SPECIAL
    config = ModelConfig.tiny("llama", vocab_size=len(tokens), eos_token_id=256, max_position_embeddings=256)
    model = Transformer.from_config(config, seed=seed)
    hf = config.to_hf()
    w = gguf_ref.GGUFWriter(path, "llama")
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_block_count(hf["num_hidden_layers"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_key_length(hf["head_dim"])
    w.add_value_length(hf["head_dim"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_rope_freq_base(hf["rope_theta"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3] * len(SPECIAL))
    w.add_token_merges([])
    w.add_eos_token_id(256)
    w.add_chat_template(CHAT_TEMPLATE)
    layer = {v: k for k, v in _LAYER_NAMES.items()}
    top = {v: k for k, v in _TOP_NAMES.items()}
    for name, p in model.named_parameters():
        t = p.detach().float()
        if name.startswith("model.layers."):
            _, _, i, *rest = name.split(".")
            module, kind = ".".join(rest[:-1]), rest[-1]
            gname = f"blk.{i}.{layer[module]}.{kind}"
            if module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = hf["num_attention_heads"] if module == "self_attn.q_proj" else hf["num_key_value_heads"]
                t = permute_rope(t, heads)
        else:
            prefix, kind = name.rsplit(".", 1)
            gname = f"{top[prefix]}.{kind}"
        w.add_tensor(gname, np.ascontiguousarray(t.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


# --- the servers and the router ----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _router(worker_urls: list[str]):
    """sglang-router in front of `worker_urls` (round robin: consecutive requests go to each server in
    turn), on a free 127.0.0.1 port; yields its URL once it has registered every server."""
    import sglang_router      # not installed: an ImportError, so that a missing router fails the tests

    assert sglang_router.__version__ == ROUTER_VERSION, sglang_router.__version__
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
                             "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
                             "--log-level", "warn", "--worker-startup-timeout-secs", "30",
                             # its metrics listener takes a port too (29000 unless told): one free one
                             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port())],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "NO_COLOR": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 30
        while True:
            assert proc.poll() is None, f"sglang-router exited: {proc.stdout.read()}"
            assert time.time() < deadline, "sglang-router did not register both servers within 30 s"
            with contextlib.suppress(httpx.HTTPError):
                workers = httpx.get(f"{url}/workers", timeout=2).json()["workers"]
                if sorted(w["url"] for w in workers if w["is_healthy"]) == sorted(worker_urls):
                    break
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The served model (seed 1), and two others of its architecture: a GGUF file and a folder."""
    root = tmp_path_factory.mktemp("routed")
    tiny_gguf(str(root / "served.gguf"), seed=1)
    tiny_gguf(str(root / "next.gguf"), seed=2)
    tiny_gguf(str(root / "third.gguf"), seed=3)
    return {"served": str(root / "served.gguf"), "gguf": str(root / "next.gguf"),
            "folder": convert_gguf(str(root / "third.gguf"), str(root / "third"))}


@pytest.fixture(scope="module")
def routed(files):
    """(the router's URL, the two servers' URLs, the served model's name)."""
    engine = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=8)
    servers = [build_server(files["served"], torch.float32, **engine) for _ in range(2)]
    with running(servers[0]) as a, running(servers[1]) as b, _router([a, b]) as url:
        yield url, [a, b], servers[0].name


def _post(url: str, path: str, body: dict, status: int = 200) -> dict | list:
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def _bits(answer: dict | list) -> list:
    """What must be equal, bit for bit: every completion's token ids and logprobs."""
    answers = answer if isinstance(answer, list) else [answer]
    keys = ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs", "input_top_logprobs")
    return [(a["output_ids"], [a["meta_info"].get(k) for k in keys]) for a in answers]


# --- the tests -----------------------------------------------------------------------------------


GENERATE = [
    {"text": "hello there", "sampling_params": {"max_new_tokens": 8, "temperature": 0.8, "sampling_seed": 3},
     "return_logprob": True},
    {"input_ids": [104, 105, 32, 121], "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3,
     "sampling_params": {"max_new_tokens": 6, "top_p": 0.9, "top_k": 20, "sampling_seed": 4}},
    {"input_ids": [[104, 105], [50, 51, 52, 53, 54, 55, 56, 57, 58, 59]], "return_logprob": True,
     "sampling_params": {"max_new_tokens": 5, "n": 2, "sampling_seed": 5, "ignore_eos": True}},
    {"text": "greedy", "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "return_logprob": True},
]


@pytest.mark.parametrize("body", GENERATE, ids=["text", "input_ids", "batch-n2", "greedy"])
def test_generate_through_the_router_has_the_bits_of_one_server(routed, body):
    url, servers, _ = routed
    direct = _bits(_post(servers[0], "/generate", body))
    assert any(logprobs[0] for _, logprobs in direct)
    for _ in servers:                      # round robin: once through each server
        assert _bits(_post(url, "/generate", body)) == direct


def test_a_stream_through_the_router_ends_with_the_answer_of_one_server(routed):
    url, servers, _ = routed
    body = {"input_ids": [[104, 105], [106]], "return_logprob": True, "stream": True,
            "sampling_params": {"max_new_tokens": 5, "sampling_seed": 6, "ignore_eos": True}}
    whole = _post(servers[0], "/generate", {**body, "stream": False})
    events = []
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = {}
    for e in map(json.loads, events[:-1]):
        last[e["index"]] = e
    assert _bits([last[k] for k in sorted(last)]) == _bits(whole)


def test_openai_client_through_the_router_has_the_bits_of_one_server(routed):
    import openai

    url, servers, name = routed
    via, direct = (openai.OpenAI(base_url=f"{u}/v1", api_key="unused", max_retries=0) for u in (url, servers[1]))
    kwargs = dict(model=name, prompt="hello", max_tokens=6, seed=2, logprobs=2, temperature=0.9,
                  extra_body={"return_token_ids": True})
    want = direct.completions.create(**kwargs).choices[0]
    for _ in servers:
        got = via.completions.create(**kwargs).choices[0]
        assert got.token_ids == want.token_ids and got.text == want.text     # vLLM's field, forwarded
        assert got.logprobs.token_logprobs == want.logprobs.token_logprobs
        assert got.logprobs.top_logprobs == want.logprobs.top_logprobs
    chat = dict(model=name, messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                max_tokens=5, logprobs=True, top_logprobs=2, seed=7)
    want = direct.chat.completions.create(**chat).choices[0]
    assert want.logprobs.content
    for _ in servers:
        got = via.chat.completions.create(**chat).choices[0]
        assert got.message.content == want.message.content
        assert got.logprobs.model_dump() == want.logprobs.model_dump()    # tokens, bytes, logprobs, tops


def test_model_and_server_info(routed):
    url, servers, name = routed
    for server in servers:
        info = httpx.get(f"{server}/get_model_info").json()
        assert httpx.get(f"{server}/model_info").json() == info and info["served_model_name"] == name
        sinfo = httpx.get(f"{server}/get_server_info").json()
        assert httpx.get(f"{server}/server_info").json() == sinfo
        assert sinfo["dp_size"] == 1 and sinfo["model_path"] == info["model_path"]
    assert httpx.get(f"{url}/get_model_info").json() == info
    assert httpx.get(f"{url}/get_server_info").json()["workers_count"] == 2      # the router's own answer
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == [name]


@pytest.mark.parametrize("path, body, message", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "echo": True}, "echo: only false is supported, got true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "no_stop_trim": True},
     "no_stop_trim: only false is supported, got true"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, "frequency_penalty": 0.5}},
     "sampling_params.frequency_penalty: only 0.0 is supported, got 0.5"),
    ("/generate", {"text": "hi", "return_hidden_states": True}, "return_hidden_states: only false is supported, "
                                                                   "got true"),
])
def test_a_value_lockstep_does_not_implement_is_refused_naming_the_field(routed, path, body, message):
    url, servers, name = routed
    body = {**body, "model": name} if path.startswith("/v1") else body
    for base in (url, servers[0]):
        error = _post(base, path, body, status=400)["error"]
        assert error["message"] == message and message.startswith(error["param"] + ":")
    r = httpx.post(f"{servers[0]}/generate", json={"text": "hi", "bogus": 1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"] == "bogus: unknown field"


def test_flush_cache_through_the_router_reaches_every_server(routed):
    url, servers, _ = routed
    body = {"input_ids": list(range(40, 60)), "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    for server in servers:
        _post(server, "/generate", body)
        assert _post(server, "/generate", body)["meta_info"]["cached_tokens"] > 0
    flushed = _post(url, "/flush_cache", {})
    assert flushed["workers_flushed"] == 2, flushed
    for server in servers:
        assert _post(server, "/generate", body)["meta_info"]["cached_tokens"] == 0


def test_weight_updates_from_a_folder_and_a_gguf_file(routed, files):
    url, servers, _ = routed
    body = {"input_ids": [104, 101, 108], "sampling_params": {"max_new_tokens": 6, "sampling_seed": 9},
            "return_logprob": True}
    # sglang-router 0.3.2 does not route weight updates: they go to each server
    assert httpx.post(f"{url}/update_weights_from_disk", json={"model_path": files["folder"]}).status_code == 404
    before = _bits(_post(url, "/generate", body))
    # load_format "auto" finds the format; a named one must be the path's
    for kind, other in (("folder", "gguf"), ("gguf", "safetensors")):
        refused = _post(servers[0], "/update_weights_from_disk", {"model_path": files[kind], "load_format": other},
                        status=400)
        held = "a safetensors checkpoint folder" if kind == "folder" else "a GGUF file"
        assert refused["message"] == (f'load_format: "{other}" was asked, but {files[kind]} is {held}; pass '
                                      f'"{"gguf" if other == "safetensors" else "safetensors"}" or "auto"'), refused
    for kind, version, load_format in (("folder", "v1", "safetensors"), ("gguf", "v2", "gguf")):
        for server in servers:
            answer = _post(server, "/update_weights_from_disk", {"model_path": files[kind], "weight_version": version,
                                                                 "load_format": load_format})
            assert answer["success"] and answer["weight_version"] == version, answer
        direct = _post(servers[0], "/generate", body)
        assert direct["meta_info"]["weight_version"] == version and _bits(direct) != before
        ids = direct["output_ids"]
        lps = [t[0] for t in direct["meta_info"]["output_token_logprobs"]]
        model = load_model(files[kind], dtype=torch.float32)
        assert lockstep.logprobs(model, [body["input_ids"] + ids])[0][-len(ids):].tolist() == lps
        for _ in servers:
            routed_answer = _post(url, "/generate", body)
            assert routed_answer["meta_info"]["weight_version"] == version and _bits(routed_answer) == _bits(direct)
        before = _bits(direct)
    refused = _post(servers[0], "/update_weights_from_disk", {"model_path": files["served"] + ".txt"}, status=400)
    assert refused["message"] == f"model_path: {files['served'] + '.txt'!r} is not a folder or a .gguf file"
