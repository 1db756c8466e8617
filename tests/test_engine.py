import dataclasses
import math
import re

import pytest
import torch

import lockstep
from lockstep import Engine, SamplingParams
from lockstep.model import ByteTokenizer, ModelConfig, Transformer, logprobs
from lockstep.sampling import uniform_noise


@pytest.fixture(scope="module")
def model():
    return Transformer.from_config(ModelConfig.tiny("qwen2", vocab_size=300), seed=4)


def _prompts(n=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (k,), generator=gen).tolist() for k in (4, 33, 1, 19, 50, 8)[:n]]


SAMPLINGS = [SamplingParams(temperature=0, max_new_tokens=10),
             SamplingParams(temperature=0.7, top_k=30, top_p=0.9, max_new_tokens=10, seed=11)]


def _run(model, prompts, sp, order=None, **engine_kw):
    order = order or list(range(len(prompts)))
    outs = Engine(model, **engine_kw).generate([prompts[i] for i in order], sp)
    result = [None] * len(prompts)
    for i, o in zip(order, outs):
        result[i] = o
    return result


@pytest.mark.parametrize("sp", SAMPLINGS, ids=["greedy", "temperature"])
@pytest.mark.parametrize("engine_kw, order", [
    (dict(max_num_seqs=1), None),
    (dict(max_num_seqs=3), None),
    (dict(max_num_batched_tokens=1), None),
    (dict(max_num_batched_tokens=7), None),
    (dict(max_num_batched_tokens=16, max_num_seqs=2), None),
    (dict(), [5, 4, 3, 2, 1, 0]),
    (dict(), [2, 0, 5, 1, 4, 3]),
    (dict(block_size=4, num_blocks=17, max_num_seqs=6), None),
    (dict(static_decode=False), None),
], ids=["seqs=1", "seqs=3", "chunk=1", "chunk=7", "chunk=16", "reversed", "shuffled", "tight-cache", "no-static-decode"])
def test_tokens_and_logprobs_do_not_depend_on_engine_settings(model, sp, engine_kw, order):
    prompts = _prompts()
    base = _run(model, prompts, sp, max_num_seqs=8, max_num_batched_tokens=256)
    got = _run(model, prompts, sp, order, **engine_kw)
    for a, b in zip(base, got):
        assert a.finish_reason == b.finish_reason == "length"
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs


@pytest.mark.parametrize("sp", SAMPLINGS, ids=["greedy", "temperature"])
def test_engine_logprobs_equal_trainer_logprobs_bitwise(model, sp):
    prompts = _prompts()
    outs = _run(model, prompts, sp, max_num_seqs=3, max_num_batched_tokens=9)
    temp = sp.temperature or 1.0
    seqs = [p + o.token_ids for p, o in zip(prompts, outs)]
    batched = logprobs(model, seqs, temperature=temp)
    for s, o, lp in zip(seqs, outs, batched):
        n = len(o.token_ids)
        assert torch.equal(lp[-n:], torch.tensor(o.logprobs))
        assert torch.equal(logprobs(model, [s], temperature=temp)[0][-n:], torch.tensor(o.logprobs))


def test_preemption_recomputes_to_the_same_bits(model):
    prompts = _prompts()
    engine = Engine(model, max_num_seqs=6, block_size=4, num_blocks=17)
    outs = engine.generate(prompts, SAMPLINGS[1])
    assert engine.stats["preemptions"] > 0
    base = _run(model, prompts, SAMPLINGS[1])
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert engine.blocks.num_free == 17, "blocks of finished requests are returned"


@pytest.mark.parametrize("fill", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_no_reader_touches_an_unwritten_cache_slot(model, fill):
    """The KV cache is allocated uninitialised: filled with NaN or inf before the run, it must give
    the bits of a zero-filled one, with chunked prefill, prefix sharing and preemption."""
    prompts = _prompts() + [_prompts()[4][:40]]             # shares its first blocks with prompt 4

    def run(value):
        engine = Engine(model, max_num_seqs=6, max_num_batched_tokens=9, block_size=4, num_blocks=23)
        for t in engine.runner.cache.k + engine.runner.cache.v:
            t.fill_(value)
        return engine.generate(prompts, SAMPLINGS[1]), engine

    zero, _ = run(0.0)
    filled, engine = run(fill)
    assert engine.stats["preemptions"] > 0
    for a, b in zip(zero, filled):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
        assert all(math.isfinite(x) for x in b.logprobs)


def test_sampling_depends_on_seed_not_on_neighbours(model):
    p = _prompts()[1]
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5)
    alone = Engine(model).generate([p], sp)[0].token_ids
    crowd = Engine(model).generate(_prompts() + [p], sp)[-1].token_ids
    other_seed = Engine(model).generate([p], SamplingParams(temperature=1.0, max_new_tokens=12, seed=6))[0].token_ids
    assert alone == crowd
    assert alone != other_seed


def test_uniform_noise_is_a_pure_function_in_range():
    a = uniform_noise(7, 100, 5000)
    assert torch.equal(a, uniform_noise(7, 100, 5000))
    assert not torch.equal(a, uniform_noise(7, 101, 5000))
    assert bool(((a > 0) & (a < 1)).all())
    assert abs(float(a.mean()) - 0.5) < 0.02


def test_stop_tokens_and_strings(model):
    m = Transformer.from_config(ModelConfig.tiny("llama", vocab_size=300), seed=1)
    m.tokenizer = ByteTokenizer()
    greedy = Engine(m).generate(["hello"], SamplingParams(temperature=0, max_new_tokens=6))[0]
    stop = greedy.token_ids[2]
    out = Engine(m).generate(["hello"], SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=[stop]))[0]
    first = greedy.token_ids.index(stop)
    assert out.finish_reason == "stop" and out.token_ids == greedy.token_ids[:first + 1]
    assert out.prompt_token_ids[0] == ByteTokenizer.bos_token_id and isinstance(out.text, str)


@pytest.mark.parametrize("prompt, sp, message", [
    ([1] * 5000, SamplingParams(), "exceed the model's context"),
    ([], SamplingParams(), "prompt: expected at least one token"),
    ([1, 2], SamplingParams(temperature=-1.0), r"temperature: expected 0 \(greedy\) or a finite number >= 1e-06"),
    ([1, 2], SamplingParams(temperature=1e-40), r"temperature: expected 0 \(greedy\) or a finite number >= 1e-06"),
    ([1, 2], SamplingParams(top_p=0.0), r"top_p: expected a number in \(0, 1\]"),
    ([1, 2], SamplingParams(top_p=1.5), r"top_p: expected a number in \(0, 1\]"),
    ([1, 2], SamplingParams(stop_token_ids=[300]), r"stop_token_ids: expected ids in \[0, 300\)"),
    ([1, 999], SamplingParams(), r"prompt: token ids must be in \[0, 300\)"),
    ("text", SamplingParams(), "prompt: a string needs a model with a tokenizer"),
])
def test_bad_request_fails_alone(model, prompt, sp, message):
    good = _prompts(2)
    outs = Engine(model).generate([good[0], prompt, good[1]], [SamplingParams(max_new_tokens=3), sp,
                                                               SamplingParams(max_new_tokens=3)])
    assert outs[1].finish_reason == "error" and re.search(message, outs[1].error), outs[1].error
    assert outs[0].finish_reason == outs[2].finish_reason == "length"


def test_engine_encode_is_deprecated_and_still_encodes(model):
    m = Transformer.from_config(ModelConfig.tiny("llama", vocab_size=300), seed=1)
    m.tokenizer = ByteTokenizer()
    with pytest.warns(DeprecationWarning, match=r"Engine.encode is deprecated; use lockstep.engine.requests.encode_prompt"):
        assert Engine(m).encode("hi") == [256, 104, 105]
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=r"prompt: token ids must be in \[0, 300\)"):
        Engine(model).encode([1, 999])


def test_stream_yields_every_request(model):
    engine = Engine(model, max_num_seqs=2)
    for p in _prompts():
        engine.add_request(p, SamplingParams(max_new_tokens=3))
    assert sorted(o.request_id for o in engine.stream()) == list(range(6))


def test_engine_bad_arguments(model):
    with pytest.raises(ValueError, match="max_num_seqs: expected a positive int"):
        Engine(model, max_num_seqs=0)
    with pytest.raises(ValueError, match="sampling: expected one SamplingParams or 2"):
        Engine(model).generate([[1], [2]], [SamplingParams()] * 3)
    with pytest.raises(ValueError, match=r"^static_decode: expected True or False, got 'yes'$"):
        Engine(model, static_decode="yes")
    with pytest.raises(ValueError, match=r"^cuda_graphs: CUDA graphs cannot be used here: the model is on cpu, "
                                         r"and they need a CUDA device$"):
        Engine(model, cuda_graphs=True)


def test_a_request_whose_logits_turn_nan_finishes_with_an_error_and_alone():
    import copy

    model = Transformer.from_config(ModelConfig.tiny("llama", vocab_size=300), seed=4)    # an untied LM head
    poisoned = copy.deepcopy(model)
    with torch.no_grad():
        poisoned.model.embed_tokens.weight[7] = float("nan")   # any request that reads token 7 turns NaN
    prompts = [p for p in _prompts() if 7 not in p][:3]
    sp = SamplingParams(temperature=0, max_new_tokens=6)
    alone = [Engine(model).generate([p], sp)[0] for p in prompts]
    assert all(7 not in o.token_ids for o in alone), "the clean requests must not sample token 7 themselves"
    outs = Engine(poisoned, max_num_seqs=4).generate(prompts[:2] + [[3, 7, 5]] + prompts[2:], sp)
    bad = outs[2]
    assert bad.finish_reason == "error" and "not finite" in bad.error and bad.token_ids == [], bad
    for o, a in zip(outs[:2] + outs[3:], alone):
        assert o.finish_reason == "length" and o.error is None
        assert o.token_ids == a.token_ids and o.logprobs == a.logprobs


def test_engine_keeps_no_output_after_handing_it_out(model):
    engine = Engine(model)
    for _ in range(3):
        engine.generate(_prompts(3), SamplingParams(max_new_tokens=2))
    assert not engine._done and not engine.has_unfinished()
    early = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
    mine = engine.generate([[4, 5]], SamplingParams(max_new_tokens=2))
    assert mine[0].request_id != early
    assert [o.request_id for o in engine.stream()] == [early], "an earlier request's output waits for its caller"


def test_generate_progress_ends_on_the_final_count(model, capsys):
    Engine(model).generate(_prompts(2), SamplingParams(max_new_tokens=2), progress=True)
    assert capsys.readouterr().err.rstrip().split("\r")[-1].startswith("[engine] 2/2 done")


FEATURES = SamplingParams(temperature=0.9, top_k=50, min_p=0.02, top_p=0.95, repetition_penalty=1.3,
                          max_new_tokens=8, n=3, logprobs=4, seed=5)


def test_n_min_p_penalty_and_top_logprobs_are_seeded_and_batch_invariant(model):
    prompts = _prompts(4)
    together = Engine(model, max_num_seqs=5, max_num_batched_tokens=16).generate(prompts, FEATURES)
    assert [(o.request_id, o.index) for o in together] == [(r, i) for r in range(4) for i in range(3)]
    for k, p in enumerate(prompts):
        alone = Engine(model).generate([p], FEATURES)
        mine = together[3 * k:3 * k + 3]
        assert [(o.token_ids, o.logprobs, o.top_logprobs) for o in alone] == \
               [(o.token_ids, o.logprobs, o.top_logprobs) for o in mine]
    completions = {tuple(o.token_ids) for o in together[:3]}
    assert len(completions) > 1, "the n completions of a prompt draw from different noise streams"
    for o in together:
        assert len(o.top_logprobs) == len(o.token_ids) and all(len(t) == 4 for t in o.top_logprobs)
        for tok, lp, top in zip(o.token_ids, o.logprobs, o.top_logprobs):
            assert [x[1] for x in top] == sorted((x[1] for x in top), reverse=True)
            assert top[0][1] >= lp and (tok not in dict(top) or dict(top)[tok] == lp)


def test_reported_logprobs_with_every_feature_equal_the_trainers(model):
    prompts = _prompts(3)
    outs = Engine(model).generate(prompts, FEATURES)
    seqs = [prompts[i // 3] + o.token_ids for i, o in enumerate(outs)]
    for o, lp in zip(outs, logprobs(model, seqs, temperature=FEATURES.temperature)):
        assert lp[-len(o.token_ids):].tolist() == o.logprobs


def test_repetition_penalty_and_min_p_change_what_is_drawn(model):
    prompt = _prompts(1)[0]
    plain = Engine(model).generate([prompt], SamplingParams(temperature=0, max_new_tokens=8))[0]
    penalized = Engine(model).generate([prompt], SamplingParams(temperature=0, max_new_tokens=8,
                                                                repetition_penalty=50.0))[0]
    assert len(set(penalized.token_ids)) > len(set(plain.token_ids)), "a strong penalty avoids repeats"
    narrow = SamplingParams(temperature=2.0, min_p=0.5, max_new_tokens=6, n=4, seed=3)
    for o in Engine(model).generate([prompt], narrow):
        lp = logprobs(model, [prompt + o.token_ids], temperature=2.0)[0][-6:]
        full = [lockstep.ops.vocab_logprobs(h, model.lm_head_weight, 2.0) for h in
                [model(*lockstep.model.pack([prompt + o.token_ids]))[len(prompt) - 1 + i] for i in range(6)]]
        for i, tok in enumerate(o.token_ids):
            assert full[i][tok] >= full[i].max() + math.log(0.5) - 1e-6, "min_p kept only likely tokens"
        assert lp.tolist() == o.logprobs


def test_stop_strings_end_a_completion_and_are_cut_from_its_text():
    m = Transformer.from_config(ModelConfig.tiny("llama", vocab_size=300), seed=1)
    m.tokenizer = ByteTokenizer()
    full = Engine(m).generate(["hello"], SamplingParams(temperature=0, max_new_tokens=12))[0]
    stop = full.text[3:5]
    out = Engine(m).generate(["hello"], SamplingParams(temperature=0, max_new_tokens=12, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:full.text.index(stop)] and stop not in out.text
    assert out.token_ids == full.token_ids[:len(out.token_ids)] and len(out.token_ids) < 12
    bad = Engine(Transformer.from_config(ModelConfig.tiny("llama", vocab_size=300))).generate(
        [[1, 2]], SamplingParams(stop=["x"]))[0]
    assert bad.finish_reason == "error" and "stop strings need a model with a tokenizer" in bad.error


def test_the_sampler_makes_one_pass_over_the_vocabulary_per_token(model, monkeypatch):
    from lockstep import ops, sampling

    calls = []
    real = ops.vocab_logprobs
    monkeypatch.setattr(sampling.ops, "vocab_logprobs", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    monkeypatch.setattr(sampling.ops, "selected_logprobs", lambda *a, **k: pytest.fail("a second pass"))
    outs = Engine(model, max_num_seqs=4).generate(_prompts(4), SamplingParams(temperature=0.7, max_new_tokens=5))
    assert sum(calls) == sum(len(o.token_ids) for o in outs) and all(c <= 4 for c in calls)


@pytest.mark.parametrize("field, value, message", [
    ("n", 0, r"n: expected an int in \[1, 128\]"),
    ("min_p", 1.5, r"min_p: expected a number in \[0, 1\]"),
    ("repetition_penalty", 0.0, "repetition_penalty: expected a positive finite number"),
    ("logprobs", 21, r"logprobs: expected an int in \[0, 20\]"),
    ("stop", ["ok", ""], "stop: expected a list of non-empty strings"),
])
def test_new_sampling_params_are_checked(model, field, value, message):
    import dataclasses

    out = Engine(model).generate([[1, 2]], dataclasses.replace(SamplingParams(), **{field: value}))
    assert out[0].finish_reason == "error" and re.search(message, out[0].error), out[0].error


def _shared_prefix_prompts():
    gen = torch.Generator().manual_seed(11)
    system = torch.randint(0, 300, (37,), generator=gen).tolist()            # 2 full blocks of 16, and more
    return [system + torch.randint(0, 300, (k,), generator=gen).tolist() for k in (3, 9, 1, 20)]


@pytest.mark.parametrize("sp", SAMPLINGS + [dataclasses.replace(SAMPLINGS[1], n=4)], ids=["greedy", "temperature", "n=4"])
@pytest.mark.parametrize("engine_kw", [dict(), dict(max_num_seqs=2), dict(max_num_batched_tokens=7),
                                       dict(block_size=4, num_blocks=40, max_num_seqs=8)],
                         ids=["default", "seqs=2", "chunk=7", "tight-cache"])
def test_a_cached_prefix_changes_no_bit(model, sp, engine_kw):
    prompts = _shared_prefix_prompts()
    cached = Engine(model, **engine_kw)
    with_cache = cached.generate(prompts, sp)
    without = Engine(model, prefix_caching=False, **engine_kw).generate(prompts, sp)
    assert [(o.token_ids, o.logprobs) for o in with_cache] == [(o.token_ids, o.logprobs) for o in without]
    assert cached.stats["cached_tokens"] > 0, "the shared prefix was computed only once"
    again = cached.generate(prompts[:1], sp)                  # finished requests leave their blocks named
    assert again[0].cached_tokens > 0 and again[0].token_ids == with_cache[0].token_ids
    assert cached.blocks.num_free == cached.blocks.num_blocks, "every block is released"


def test_n_completions_share_their_prompt_blocks(model):
    prompt = _shared_prefix_prompts()[3]                       # 57 tokens: 3 full blocks of 16
    engine = Engine(model, max_num_seqs=4)
    outs = engine.generate([prompt], dataclasses.replace(SAMPLINGS[1], n=4))
    assert [o.cached_tokens for o in outs] == [0, 48, 48, 48]
    alone = [Engine(model, prefix_caching=False).generate([prompt], dataclasses.replace(SAMPLINGS[1], n=4))[i]
             for i in range(4)]
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]


def test_abort_frees_a_requests_blocks(model):
    engine = Engine(model, max_num_seqs=4)
    rid = engine.add_request(_prompts(1)[0], dataclasses.replace(SAMPLINGS[1], n=3, max_new_tokens=50))
    engine.step()
    assert engine.blocks.num_free < engine.blocks.num_blocks
    engine.abort(rid)
    assert not engine.has_unfinished() and engine.blocks.num_free == engine.blocks.num_blocks


def test_load_weights_forgets_the_prefix_cache_and_refuses_while_running(model):
    import copy

    m = copy.deepcopy(model)
    engine = Engine(m)
    prompt = _shared_prefix_prompts()[0]
    first = engine.generate([prompt], SAMPLINGS[0])[0]
    new = {n: p.detach() * 1.01 for n, p in m.named_parameters()}
    engine.load_weights(new)
    after = engine.generate([prompt], SAMPLINGS[0])[0]
    assert after.cached_tokens == 0, "old keys and values are not reused"
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in reference.named_parameters():
            p.copy_(new[n])
    assert after.token_ids == Engine(reference).generate([prompt], SAMPLINGS[0])[0].token_ids
    engine.add_request(prompt, SAMPLINGS[0])
    with pytest.raises(RuntimeError, match="load_weights: requests are running"):
        engine.load_weights(new)
    with pytest.raises(ValueError, match="weights: do not fit the model"):
        Engine(m).load_weights({"x": torch.zeros(1)})
    assert first.token_ids is not None
