"""`lockstep serve`'s SGLang native API over loopback: a real uvicorn server, an httpx client that
speaks SGLang's documented shapes (POST /generate with sampling_params, return_logprob and
meta_info; /update_weights_from_disk with weight_version and abort_all_requests; /flush_cache;
/get_model_info). Every completion is checked against the same request run alone in process, and
its logprobs against lockstep.logprobs, bit for bit."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

import lockstep
from lockstep import Engine, SamplingParams
from lockstep.model import ModelConfig, Transformer, load_model
# The same served tiny model as test_server.py's (module-scoped: one server for this module).
from test_server import _server, folder, live, running  # noqa: F401  (fixtures)


def _generate(url, body, status=200):
    r = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def _trainer(model, prompt, tokens, temperature):
    return lockstep.logprobs(model, [prompt + tokens], temperature=temperature)[0][-len(tokens):].tolist()


def _check(model, prompt, answer, temperature):
    """SGLang's shape, and logprobs that are the trainer's bits."""
    meta = answer["meta_info"]
    ids = answer["output_ids"]
    assert meta["completion_tokens"] == len(ids) and meta["prompt_tokens"] == len(prompt)
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == ids and all(len(t) == 3 for t in triples)
    assert [t[0] for t in triples] == _trainer(model, prompt, ids, temperature)


def test_single_text_and_input_ids_give_the_same_exact_completion(live):
    server, url = live
    prompt = server.tokenizer.encode("w1 w2 w3")
    sampling = {"max_new_tokens": 6, "temperature": 0.8, "top_p": 0.9, "top_k": 40, "sampling_seed": 3}
    by_text = _generate(url, {"text": "w1 w2 w3", "sampling_params": sampling, "return_logprob": True, "rid": "r1"})
    by_ids = _generate(url, {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True})
    assert isinstance(by_text, dict) and by_text["meta_info"]["id"] == "r1"
    assert by_text["output_ids"] == by_ids["output_ids"] and by_text["text"] == by_ids["text"]
    meta = by_text["meta_info"]
    assert meta["weight_version"] == "0" and meta["finish_reason"]["type"] in ("length", "stop")
    assert by_text["text"] == server.tokenizer.decode(by_text["output_ids"]) or meta["finish_reason"]["type"] == "stop"
    _check(server.model, prompt, by_text, 0.8)
    alone = Engine(server.model).generate([prompt], SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=3,
                                                                   max_new_tokens=6, stop_token_ids=[1]))[0]
    assert by_ids["output_ids"] == alone.token_ids
    assert [t[0] for t in by_ids["meta_info"]["output_token_logprobs"]] == alone.logprobs
    assert "input_token_logprobs" not in meta and "output_top_logprobs" not in meta


def test_batches_are_answered_prompt_by_prompt_as_if_each_were_alone(live):
    server, url = live
    prompts = [[5, 6, 7], list(range(10, 40)), [9]]
    sampling = {"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": 7}
    batch = _generate(url, {"input_ids": prompts, "sampling_params": sampling, "return_logprob": True,
                            "rid": ["a", "b", "c"]})
    assert isinstance(batch, list) and [a["meta_info"]["id"] for a in batch] == ["a", "b", "c"]
    for prompt, answer in zip(prompts, batch):
        assert answer["output_ids"] == _generate(url, {"input_ids": prompt, "sampling_params": sampling})["output_ids"]
        _check(server.model, prompt, answer, 1.0)
    texts = _generate(url, {"text": ["w4 w5", "w6"], "sampling_params": [{"max_new_tokens": 3, "temperature": 0},
                                                                        {"max_new_tokens": 4, "temperature": 0}]})
    assert [a["meta_info"]["prompt_tokens"] for a in texts] == [2, 1]
    assert texts[1]["meta_info"]["completion_tokens"] <= 4


def test_n_completions_with_a_sampling_seed_are_reproducible(live):
    server, url = live
    body = {"input_ids": [3, 1, 4, 1, 5], "return_logprob": True,
            "sampling_params": {"n": 3, "sampling_seed": 11, "max_new_tokens": 8, "temperature": 1.0}}
    first, again = _generate(url, body), _generate(url, body)
    assert isinstance(first, list) and len(first) == 3
    assert [a["output_ids"] for a in first] == [a["output_ids"] for a in again]
    assert [a["meta_info"]["output_token_logprobs"] for a in first] == [a["meta_info"]["output_token_logprobs"]
                                                                       for a in again]
    alone = Engine(server.model).generate([body["input_ids"]], SamplingParams(n=3, seed=11, max_new_tokens=8,
                                                                              stop_token_ids=[1]))
    assert [a["output_ids"] for a in first] == [o.token_ids for o in alone]
    assert len({tuple(a["output_ids"]) for a in first}) > 1, "the n completions are independent draws"
    other = _generate(url, {**body, "sampling_params": {**body["sampling_params"], "sampling_seed": 12}})
    assert [a["output_ids"] for a in other] != [a["output_ids"] for a in first]
    batch = _generate(url, {"input_ids": [[3, 1, 4, 1, 5], [2, 7]], "sampling_params": body["sampling_params"]})
    assert [a["output_ids"] for a in batch[:3]] == [a["output_ids"] for a in first] and len(batch) == 6


def test_prompt_and_top_logprobs_are_the_trainers(live):
    server, url = live
    prompt = [4, 8, 15, 16, 23, 42]
    answer = _generate(url, {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
                             "top_logprobs_num": 3, "return_text_in_logprobs": True,
                             "sampling_params": {"max_new_tokens": 5, "temperature": 0.7, "sampling_seed": 5}})
    meta = answer["meta_info"]
    _check(server.model, prompt, answer, 0.7)
    inputs = meta["input_token_logprobs"]
    assert [t[1] for t in inputs] == prompt and inputs[0][0] is None
    assert [t[0] for t in inputs[1:]] == lockstep.logprobs(server.model, [prompt], temperature=0.7)[0].tolist()
    assert all(t[2] == server.text_of(t[1]) for t in inputs + meta["output_token_logprobs"])
    assert meta["input_top_logprobs"][0] is None and all(len(step) == 3 for step in meta["input_top_logprobs"][1:])
    tops = meta["output_top_logprobs"]
    assert len(tops) == len(answer["output_ids"])
    for step, (lp, token, _) in zip(tops, meta["output_token_logprobs"]):
        values = [v for v, _, _ in step]
        assert values == sorted(values, reverse=True) and lp <= values[0]
        assert all(v == lp for v, t, _ in step if t == token)     # the same bits as the drawn token's
    later = _generate(url, {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 4,
                            "sampling_params": {"max_new_tokens": 1, "temperature": 0.7}})
    assert later["meta_info"]["input_token_logprobs"] == [t[:2] + [None] for t in inputs[4:]]


def test_stop_strings_end_a_completion(live):
    server, url = live
    body = {"input_ids": [2, 3, 4], "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    full = _generate(url, body)
    words = [w for w in (server.text_of(t) for t in full["output_ids"][2:]) if w]
    stop = words[0]
    cut = _generate(url, {**body, "sampling_params": {**body["sampling_params"], "stop": [stop]}})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == full["text"][:full["text"].index(stop)] and stop not in cut["text"]
    assert cut["output_ids"] == full["output_ids"][:len(cut["output_ids"])] and len(cut["output_ids"]) < 12


def _events(url, body):
    events = []
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                assert line.startswith("data: ")
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return events


def test_streaming_as_sglang_does_it(live):
    server, url = live
    body = {"input_ids": [[9, 8, 7], [6, 5]], "return_logprob": True, "top_logprobs_num": 1,
            "sampling_params": {"n": 2, "max_new_tokens": 6, "temperature": 0.9, "sampling_seed": 2}}
    whole = _generate(url, body)
    events = _events(url, {**body, "stream": True})
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    for k, answer in enumerate(whole):
        mine = [e for e in events[:-1] if e["index"] == k]
        assert [e["meta_info"]["finish_reason"] for e in mine[:-1]] == [None] * (len(mine) - 1)
        assert [len(e["output_ids"]) for e in mine[:-1]] == list(range(1, len(mine)))   # the whole of it so far
        last = mine[-1]
        assert last["output_ids"] == answer["output_ids"] and last["text"] == answer["text"]
        assert last["meta_info"]["finish_reason"] == answer["meta_info"]["finish_reason"]
        assert last["meta_info"]["output_token_logprobs"] == answer["meta_info"]["output_token_logprobs"]
        assert last["meta_info"]["output_top_logprobs"] == answer["meta_info"]["output_top_logprobs"]
    single = _events(url, {"input_ids": [1, 2], "stream": True, "sampling_params": {"max_new_tokens": 2}})
    assert "index" not in single[0] and single[-1] == "[DONE]"


@pytest.mark.parametrize("body, param", [
    ("{not json", "body"),
    ({"text": "w1", "bogus": 1}, "bogus"),
    ({"text": "w1", "sampling_params": {"max_tokens": 3}}, "sampling_params.max_tokens"),
    ({"text": "w1", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ({"text": "w1", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"text": "w1", "input_ids": [1, 2]}, "text"),
    ({"sampling_params": {"max_new_tokens": 2}}, "text"),
    ({"input_ids": [1, 500]}, "input_ids"),
    ({"input_ids": [[1, 2], []]}, "input_ids"),
    ({"input_ids": list(range(20)) * 13}, "input_ids"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 300}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"input_ids": [[1], [2]], "sampling_params": [{"max_new_tokens": 1}]}, "sampling_params"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}, {"top_p": 0}]}, "sampling_params.1.top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [500]}}, "sampling_params.stop_token_ids"),
    ({"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 50}, "top_logprobs_num"),
    ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2}, "logprob_start_len"),
    ({"input_ids": [1, 2], "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": [[1], [2]], "rid": ["same", "same"]}, "rid"),
])
def test_bad_requests_get_a_4xx_naming_the_field_and_the_server_keeps_serving(live, body, param):
    server, url = live
    kwargs = ({"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str)
              else {"json": body})
    r = httpx.post(f"{url}/generate", timeout=30, **kwargs)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
    assert _generate(url, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})["output_ids"]


def test_model_info_health_flush_cache_and_bad_weight_updates(live, tmp_path):
    server, url = live
    info = httpx.get(f"{url}/get_model_info").json()
    assert info["is_generation"] is True and info["weight_version"] == "0" and info["model_path"] == server.model_path
    assert {"model_path", "tokenizer_path", "weight_version"} <= set(info)
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and health.json()["weight_version"] == "0"
    r = httpx.post(f"{url}/flush_cache", timeout=30)
    assert r.status_code == 200 and r.json()["success"] is True
    for body, param in [({"model_path": str(tmp_path / "nowhere"), "weight_version": "v1"}, "model_path"),
                        ({"model_path": 3}, "model_path"),
                        ({"model_path": str(tmp_path), "token_step": 1}, "token_step")]:
        r = httpx.post(f"{url}/update_weights_from_disk", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert r.json()["error"]["message"] == "token_step: unknown field"
    # SGLang's other fields: at the values that change nothing here, or refused by name.
    r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(tmp_path), "load_format": "pt"}, timeout=30)
    assert r.status_code == 400 and r.json()["success"] is False, r.text
    assert r.json()["error"] == {**r.json()["error"], "param": "load_format",
                                 "message": 'load_format: only null or "auto" or "safetensors" or "gguf" is supported, '
                                            'got "pt"'}
    r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(tmp_path / "nowhere"),
                                                            "load_format": "auto", "flush_cache": False}, timeout=30)
    refused = r.json()
    assert refused["success"] is False and refused["num_paused_requests"] == 0 and "is not a folder" in refused["message"]
    assert httpx.get(f"{url}/get_model_info").json()["weight_version"] == "0"
    answer = _generate(url, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
    assert answer["meta_info"]["weight_version"] == "0"


def _new_weights(path, seed):
    model = Transformer.from_config(ModelConfig.tiny("qwen3", vocab_size=96, eos_token_id=1,
                                                     max_position_embeddings=256), seed=seed)
    model.save(str(path))
    return model


async def _stream_until(client, url, body, started: asyncio.Event) -> list:
    """A /generate stream's events; `started` is set when its first token has come."""
    events = []
    async with client.stream("POST", f"{url}/generate", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                started.set()
    return events


def test_a_weight_update_during_a_stream_drains_or_aborts_and_loses_nothing(folder, tmp_path):
    v7, v8 = _new_weights(tmp_path / "v7", seed=7), _new_weights(tmp_path / "v8", seed=8)
    old = load_model(str(folder), dtype=torch.float32)
    server = _server(folder)
    prompt = [3, 4, 5]

    def long(n):
        return {"input_ids": prompt, "stream": True, "return_logprob": True,
                "sampling_params": {"max_new_tokens": n, "ignore_eos": True, "sampling_seed": 1}}

    with running(server) as url:
        async def scenario(body, update):
            async with httpx.AsyncClient(timeout=120) as client:
                started = asyncio.Event()
                stream = asyncio.create_task(_stream_until(client, url, body, started))
                await asyncio.wait_for(started.wait(), 60)
                answer = await client.post(f"{url}/update_weights_from_disk", json=update)
                after = await client.post(f"{url}/generate", json={**long(8), "stream": False})
                return await stream, answer.json(), after.json()

        # abort_all_requests false: the stream finishes on the weights it began with
        events, answer, after = asyncio.run(scenario(long(24), {
            "model_path": str(tmp_path / "v7"), "weight_version": "v7", "abort_all_requests": False}))
        assert answer["success"] and answer["num_paused_requests"] == 0 and answer["weight_version"] == "v7"
        last = events[-2]
        assert events[-1] == "[DONE]" and last["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
        assert {e["meta_info"]["weight_version"] for e in events[:-1]} == {"0"}
        _check(old, prompt, last, 1.0)
        assert after["meta_info"]["weight_version"] == "v7"
        _check(v7, prompt, after, 1.0)
        assert httpx.get(f"{url}/get_model_info").json()["model_path"] == str(tmp_path / "v7")

        # abort_all_requests true: the stream ends now, finish_reason abort, with the tokens it has
        events, answer, after = asyncio.run(scenario(long(250), {
            "model_path": str(tmp_path / "v8"), "weight_version": "v8", "abort_all_requests": True, "flush_cache": True}))
        assert answer["success"] and answer["num_paused_requests"] == 1 and answer["weight_version"] == "v8"
        last = events[-2]
        assert events[-1] == "[DONE]" and last["meta_info"]["finish_reason"]["type"] == "abort"
        assert 1 <= last["meta_info"]["completion_tokens"] < 250
        assert {e["meta_info"]["weight_version"] for e in events[:-1]} == {"v7"}
        _check(v7, prompt, last, 1.0)                      # the tokens it has are v7's, every one
        assert after["meta_info"]["weight_version"] == "v8"
        _check(v8, prompt, after, 1.0)
        health = httpx.get(f"{url}/health").json()
        assert health["weight_version"] == "v8" and health["weights_version"] == 2 and health["in_flight"] == 0
        assert health["free_kv_blocks"] == health["kv_blocks"]
