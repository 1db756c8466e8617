import re

import pytest
import torch

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
], ids=["seqs=1", "seqs=3", "chunk=1", "chunk=7", "chunk=16", "reversed", "shuffled", "tight-cache"])
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
    assert len(engine.free) == 17, "blocks of finished requests are returned"


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
    ([1, 2], SamplingParams(temperature=-1.0), "temperature: expected a finite number >= 0"),
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
