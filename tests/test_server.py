"""`lockstep serve`: a real uvicorn server on 127.0.0.1, real HTTP clients (httpx, OpenAI's own).

Every answer is checked bit for bit against the same request run alone by an in-process Engine and
against lockstep.logprobs on its tokens."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import httpx
import pytest
import torch

import lockstep
from lockstep import Engine, SamplingParams
from lockstep.model import ModelConfig, Transformer, load_model
from lockstep.server import Server, create_app, weights_from_folder

CHAT_TEMPLATE = ("{% for m in messages %}{{ '<' + m['role'] + '> ' + m['content'] + ' ' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<assistant> ' }}{% endif %}")


def _folder(path, seed=1):
    """A model folder with a word-level tokenizer and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<eos>", "<user>", "<assistant>", "<system>"] + [f"w{i}" for i in range(60)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    model = Transformer.from_config(ModelConfig.tiny("qwen3", vocab_size=96, eos_token_id=1,
                                                     max_position_embeddings=256), seed=seed)
    model.save(str(path))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<eos>"}))
    return path


@contextlib.contextmanager
def running(server: Server):
    """The app on a free 127.0.0.1 port, in a thread; yields its base URL."""
    import uvicorn

    config = uvicorn.Config(create_app(server), host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not (srv.started and srv.servers):
        assert time.time() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    port = srv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=30)


def _server(path, **kw) -> Server:
    model = load_model(str(path), dtype=torch.float32)
    return Server(model, "tiny", dict(max_num_seqs=16, max_num_batched_tokens=64, block_size=8), model_dir=str(path),
                  load_weights=lambda p: weights_from_folder(p, model), **kw)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return _folder(tmp_path_factory.mktemp("served") / "model")


@pytest.fixture(scope="module")
def live(folder):
    server = _server(folder)
    with running(server) as url:
        yield server, url


def _alone(model, prompt, sp):
    return Engine(model).generate([prompt], sp)


def _assert_exact(model, prompt, tokens, logprobs_, temperature):
    trainer = lockstep.logprobs(model, [prompt + tokens], temperature=temperature)[0][-len(tokens):]
    assert trainer.tolist() == logprobs_


def test_health_and_models(live):
    server, url = live
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    body = httpx.get(f"{url}/v1/models").json()
    assert body["data"][0]["id"] == "tiny" and body["data"][0]["max_model_len"] == 256


def test_completions_equal_the_request_alone_and_the_trainer(live):
    server, url = live
    prompts = [[5, 6, 7], list(range(5, 45)), "w1 w2 w3 w4"]
    for prompt in prompts:
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0.8, "top_p": 0.9, "seed": 4, "n": 2,
                "logprobs": 3, "return_token_ids": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        ids = r["choices"][0]["prompt_token_ids"]
        alone = _alone(server.model, ids, SamplingParams(temperature=0.8, top_p=0.9, seed=4, n=2, max_new_tokens=6,
                                                         logprobs=3, stop_token_ids=[1]))
        for choice, out in zip(r["choices"], alone):
            assert choice["token_ids"] == out.token_ids and choice["logprobs"]["token_logprobs"] == out.logprobs
            _assert_exact(server.model, ids, choice["token_ids"], choice["logprobs"]["token_logprobs"], 0.8)
            assert len(choice["logprobs"]["top_logprobs"]) == len(out.token_ids)
        assert r["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in alone)
        assert r["weights_version"] == server.worker.version


def test_chat_uses_the_folders_chat_template(live):
    server, url = live
    messages = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w1 w2"}]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "seed": 1,
                                                       "logprobs": True, "top_logprobs": 2, "return_token_ids": True},
                   timeout=60).json()
    assert r["prompt_token_ids"] == server.tokenizer.encode("<system> w9 <user> w1 w2 <assistant> ", add_bos=False)
    choice = r["choices"][0]
    lps = [c["logprob"] for c in choice["logprobs"]["content"]]
    _assert_exact(server.model, r["prompt_token_ids"], choice["token_ids"], lps, 1.0)
    assert choice["message"]["role"] == "assistant" and all(len(c["top_logprobs"]) == 2
                                                            for c in choice["logprobs"]["content"])


def test_openai_client(live):
    import openai

    server, url = live
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    done = client.completions.create(model="tiny", prompt="w3 w4 w5", max_tokens=4, seed=2, logprobs=1,
                                     extra_body={"return_token_ids": True})
    assert done.choices[0].finish_reason in ("length", "stop") and len(done.choices[0].logprobs.token_logprobs) >= 1
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w7"}], max_tokens=3,
                                          logprobs=True, seed=5)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    streamed = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w7"}],
                                              max_tokens=3, logprobs=True, seed=5, stream=True)
    lps = [c.logprob for chunk in streamed for choice in chunk.choices if choice.logprobs
           for c in choice.logprobs.content]
    assert lps == [c.logprob for c in chat.choices[0].logprobs.content]


def _sse(url, body):
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
            elif line == "data: [DONE]":
                events.append("[DONE]")
    return events


def test_streaming_gives_the_same_tokens_and_logprobs(live):
    server, url = live
    body = {"prompt": [9, 8, 7, 6], "max_tokens": 7, "temperature": 0.9, "seed": 7, "n": 3, "logprobs": 0,
            "return_token_ids": True}
    whole = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    events = _sse(url, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    for choice in whole["choices"]:
        mine = [e["choices"][0] for e in events[:-2] if e["choices"][0]["index"] == choice["index"]]
        tokens = [t for c in mine for t in c.get("token_ids", [])]
        lps = [x for c in mine if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
        assert tokens == choice["token_ids"] and lps == choice["logprobs"]["token_logprobs"]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert mine[-1]["finish_reason"] == choice["finish_reason"]


@pytest.mark.parametrize("body, status, param", [
    ("{not json", 400, "body"),
    ({"prompt": [1, 2], "bogus": 1}, 400, "bogus"),
    ({"prompt": [1, 2], "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": [1, 2], "temperature": -1}, 400, "temperature"),
    ({"prompt": [1, 500]}, 400, "prompt"),
    ({"prompt": list(range(20)) * 13}, 400, "prompt"),
    ({"prompt": [1, 2], "max_tokens": 300}, 400, "max_tokens"),
    ({"prompt": [1, 2], "n": 0}, 400, "n"),
    ({"prompt": [1, 2], "n": 1000}, 400, "n"),
    ({"prompt": [1, 2], "logprobs": 50}, 400, "logprobs"),
    ({"prompt": []}, 400, "prompt"),
    ({"max_tokens": 3}, 400, "prompt"),
])
def test_bad_requests_get_a_4xx_naming_the_field_and_the_server_keeps_serving(live, body, status, param):
    server, url = live
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else {"json": body}
    r = httpx.post(f"{url}/v1/completions", timeout=30, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_chat_bad_input(live):
    server, url = live
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.role"
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "w1"}],
                                                       "top_logprobs": 2}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_weight_updates_never_mix_versions(folder, tmp_path):
    new_folder = tmp_path / "new"
    new_model = Transformer.from_config(ModelConfig.tiny("qwen3", vocab_size=96, eos_token_id=1,
                                                         max_position_embeddings=256), seed=2)
    new_model.save(str(new_folder))
    server = _server(folder)
    old_model = load_model(str(folder), dtype=torch.float32)
    with running(server) as url:
        async def scenario():
            async with httpx.AsyncClient(timeout=120) as client:
                long = asyncio.create_task(client.post(f"{url}/v1/completions", json={
                    "prompt": [3, 4, 5], "max_tokens": 250, "seed": 1, "logprobs": 0, "return_token_ids": True,
                    "ignore_eos": True}))
                while (await client.get(f"{url}/health")).json()["in_flight"] == 0:
                    await asyncio.sleep(0.01)
                update = await client.post(f"{url}/update_weights_from_disk", json={"model_path": str(new_folder)})
                # The server's own count: the long request ended before the update answered (the
                # client's task for it may not have been scheduled yet, so long.done() would race).
                assert (await client.get(f"{url}/health")).json()["in_flight"] == 0, \
                    "the update waited for the request in flight"
                after = await client.post(f"{url}/v1/completions", json={
                    "prompt": [3, 4, 5], "max_tokens": 5, "seed": 1, "logprobs": 0, "return_token_ids": True})
                return (await long).json(), update.json(), after.json()

        long, update, after = asyncio.run(scenario())
        assert update["success"] and update["weights_version"] == 1
        assert long["weights_version"] == 0 and after["weights_version"] == 1
        c = long["choices"][0]
        _assert_exact(old_model, [3, 4, 5], c["token_ids"], c["logprobs"]["token_logprobs"], 1.0)
        c = after["choices"][0]
        _assert_exact(new_model, [3, 4, 5], c["token_ids"], c["logprobs"]["token_logprobs"], 1.0)
        # a missing or incompatible folder: a 400, and the weights stay
        r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(tmp_path / "nowhere")}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model_path"
        other = tmp_path / "other"
        Transformer.from_config(ModelConfig.tiny("qwen3", vocab_size=96, hidden_size=32)).save(str(other))
        r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(other)}, timeout=30)
        assert r.status_code == 400 and "another architecture" in r.json()["error"]["message"]
        assert httpx.get(f"{url}/health").json()["weights_version"] == 1
        # the weights as the body of the request
        from safetensors.torch import save
        raw = save({n: p.detach().contiguous() for n, p in old_model.named_parameters()})
        r = httpx.post(f"{url}/update_weights", content=raw, timeout=60)
        assert r.json()["weights_version"] == 2
        again = httpx.post(f"{url}/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 5, "seed": 1,
                                                          "logprobs": 0, "return_token_ids": True}, timeout=60).json()
        assert again["choices"][0]["token_ids"] == long["choices"][0]["token_ids"][:5]
        r = httpx.post(f"{url}/update_weights", content=b"garbage", timeout=30)
        assert r.status_code == 400 and httpx.get(f"{url}/health").json()["weights_version"] == 2


def test_api_key(folder):
    server = _server(folder, api_key="s3cret")
    with running(server) as url:
        body = {"prompt": [1, 2], "max_tokens": 2}
        r = httpx.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["param"] == "authorization"
        assert httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert httpx.post(f"{url}/v1/completions", json=body,
                          headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/v1/models").status_code == 401
        # A client that gives up on a long request frees its work, with the key's middleware in place (240
        # tokens take about 0.5 s on 2 cores; the client gives up after 0.1 s).
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 240, "ignore_eos": True},
                       headers={"Authorization": "Bearer s3cret"}, timeout=0.1)
        deadline = time.time() + 10
        while httpx.get(f"{url}/health").json()["in_flight"] and time.time() < deadline:
            time.sleep(0.1)
        assert httpx.get(f"{url}/health").json()["in_flight"] == 0, "the abandoned request kept running"


def test_a_template_refusal_is_a_400_naming_messages(tmp_path):
    path = _folder(tmp_path / "m")
    strict = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
              + CHAT_TEMPLATE)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": strict, "eos_token": "<eos>"}))
    with running(_server(path)) as url:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={"messages": [
            {"role": "system", "content": "w1"}, {"role": "user", "content": "w2"}], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "System role not supported" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": "user", "content": "w2"}], "max_tokens": 2})
        assert r.status_code == 200


def test_without_max_tokens_a_request_gets_what_the_cache_holds(tmp_path):
    """A cache smaller than the context: the default budget is what the cache leaves, not a 400
    about a max_tokens the client never sent."""
    path = _folder(tmp_path / "m")
    model = load_model(str(path), dtype=torch.float32)
    server = Server(model, "tiny", dict(max_num_seqs=1, max_num_batched_tokens=64, block_size=8, num_blocks=4),
                    model_dir=str(path))
    with running(server) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "w1 w2"}],
                                                           "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 4 * 8       # the whole cache, 4 blocks of 8
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "w1"}],
                                                           "max_tokens": 100}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_a_caller_that_gives_up_on_a_weight_update_leaves_the_engine_running(folder, tmp_path):
    """The update's future is cancelled while it waits for a request in flight: the engine thread
    survives, the update is not applied, and the next requests are served."""
    new_folder = tmp_path / "new"
    Transformer.from_config(ModelConfig.tiny("qwen3", vocab_size=96, eos_token_id=1, max_position_embeddings=256),
                            seed=2).save(str(new_folder))
    server = _server(folder)
    with running(server) as url:
        async def scenario():
            async with httpx.AsyncClient(timeout=120) as client:
                long = asyncio.create_task(client.post(f"{url}/v1/completions", json={
                    "prompt": [3, 4, 5], "max_tokens": 200, "ignore_eos": True}))
                while (await client.get(f"{url}/health")).json()["in_flight"] == 0:
                    await asyncio.sleep(0.01)
                future = server.worker.update_weights(weights_from_folder(str(new_folder), server.model))
                future.cancel()
                return (await long).status_code

        assert asyncio.run(scenario()) == 200
        health = httpx.get(f"{url}/health").json()
        assert server.worker.alive and health["weights_version"] == 0
        assert httpx.post(f"{url}/v1/completions", json={"prompt": [3], "max_tokens": 2}, timeout=60).status_code == 200
        server.worker.stop()                       # a stopped engine thread: /health says so
        assert httpx.get(f"{url}/health").status_code == 503


def test_load_every_request_answered_once_and_exactly(live):
    """Many concurrent clients on loopback (bounded: 48 requests, 3 minutes): mixed lengths, n > 1,
    streaming and not; each answer equals the same request run alone, bit for bit."""
    server, url = live
    gen = torch.Generator().manual_seed(5)
    bodies = []
    for i in range(48):
        prompt = torch.randint(5, 96, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen).tolist()
        bodies.append({"prompt": prompt, "max_tokens": 1 + i % 9, "temperature": [0.0, 0.7, 1.0][i % 3], "seed": i,
                       "n": 1 + i % 3, "logprobs": 0, "return_token_ids": True, "stream": i % 2 == 1})

    async def one(client, body):
        if not body["stream"]:
            return (await client.post(f"{url}/v1/completions", json=body)).json()
        tokens, lps = {}, {}
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    e = json.loads(line[6:])
                    for c in e["choices"]:
                        tokens.setdefault(c["index"], []).extend(c.get("token_ids", []))
                        if c["logprobs"]:
                            lps.setdefault(c["index"], []).extend(c["logprobs"]["token_logprobs"])
        return {"choices": [{"token_ids": tokens.get(i, []), "logprobs": {"token_logprobs": lps.get(i, [])}}
                            for i in range(body["n"])]}

    async def everyone():
        async with httpx.AsyncClient(timeout=180, limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, b) for b in bodies)), timeout=180)

    answers = asyncio.run(everyone())
    assert len(answers) == len(bodies)
    for body, answer in zip(bodies, answers):
        sp = SamplingParams(temperature=body["temperature"], seed=body["seed"], n=body["n"],
                            max_new_tokens=body["max_tokens"], stop_token_ids=[1])
        alone = _alone(server.model, body["prompt"], sp)
        assert len(answer["choices"]) == body["n"]
        for choice, out in zip(answer["choices"], alone):
            assert choice["token_ids"] == out.token_ids and choice["logprobs"]["token_logprobs"] == out.logprobs
    health = httpx.get(f"{url}/health").json()
    assert health["in_flight"] == 0 and health["free_kv_blocks"] == health["kv_blocks"]


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(live):
    server, url = live
    body = {"prompt": [4, 5, 6], "max_tokens": 250, "n": 8, "stream": True, "seed": 3, "ignore_eos": True}
    before = server.worker.engine.stats["tokens"]
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for i, line in enumerate(r.iter_lines()):
            if i > 6:
                break                                  # hang up after a few tokens
    deadline = time.time() + 30
    while True:
        health = httpx.get(f"{url}/health").json()
        if health["in_flight"] == 0 and health["free_kv_blocks"] == health["kv_blocks"]:
            break
        assert time.time() < deadline, health
        time.sleep(0.1)
    assert server.worker.engine.stats["tokens"] - before < 8 * 250, "the request was stopped, not run to its end"


def test_completions_stop_at_the_models_eos_unless_told_not_to(live):
    server, url = live
    seen_eos = False
    for seed in range(40):
        body = {"prompt": [2, 3], "max_tokens": 30, "temperature": 1.5, "seed": seed, "return_token_ids": True}
        choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        if 1 in choice["token_ids"]:
            seen_eos = True
            assert choice["token_ids"][-1] == 1 and choice["finish_reason"] == "stop"
            raw = httpx.post(f"{url}/v1/completions", json={**body, "ignore_eos": True}, timeout=60).json()
            assert raw["choices"][0]["token_ids"][:len(choice["token_ids"])] == choice["token_ids"]
            assert len(raw["choices"][0]["token_ids"]) == 30
            break
    assert seen_eos, "no sample reached the end-of-sequence token"
