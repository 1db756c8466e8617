"""The engine's decode steps captured and replayed on the CPU (engine/step_graph.py, ADR 0043):
every replayed step has the bits of the same step run eagerly, whatever the lengths of its rows,
and a step that a replay cannot stand for stays eager and says why."""

from __future__ import annotations

import pytest
import torch

from lockstep.engine import Engine
from lockstep.engine import step_graph
from lockstep.model import ModelConfig, Transformer
from lockstep.registry import use_backend
from lockstep.sampling import SamplingParams

aten = torch.ops.aten
PROMPTS = [[1, 7, 3], [4, 2, 9, 9, 5, 6, 1], [8], [3, 3, 2, 7, 1]]
# Of other lengths, so that rows finish at other steps and the buckets shrink from 4 rows to 1.
PARAMS = [SamplingParams(max_new_tokens=14, temperature=0.0, logprobs=2),
          SamplingParams(max_new_tokens=9, temperature=0.8, top_k=20, top_p=0.9, seed=3),
          SamplingParams(max_new_tokens=5, temperature=0.7, min_p=0.05, repetition_penalty=1.3, seed=4),
          SamplingParams(max_new_tokens=20, temperature=1.0, seed=5)]


def _model(family: str, dtype: torch.dtype = torch.float32, layers: int = 2) -> Transformer:
    extra = {"layer_types": ("sliding_attention", "full_attention") * (layers // 2)} if family == "gemma3_text" else {}
    torch.manual_seed(0)
    return Transformer.from_config(ModelConfig.tiny(family, num_layers=layers, **extra)).to(dtype)


def _generate(model: Transformer, cpu_graphs: bool, late: list[int] | None = None):
    """Every completion's (tokens, logprobs, top logprobs), and the engine; `late` joins after a few
    steps, so that a bucket grows again."""
    engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=16, block_size=4, cpu_graphs=cpu_graphs)
    for prompt, params in zip(PROMPTS, PARAMS):
        engine.add_request(prompt, params)
    done, steps = [], 0
    while engine.has_unfinished():
        done += engine.step()
        steps += 1
        if steps == 6 and late is not None:
            engine.add_request(late, SamplingParams(max_new_tokens=7, temperature=0.9, seed=11))
    done.sort(key=lambda o: o.request_id)
    return [(o.token_ids, o.logprobs, o.top_logprobs) for o in done], engine


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3_text"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_replayed_decode_steps_have_the_bits_of_eager_ones(family, dtype):
    model = _model(family, dtype)
    with use_backend("native"):
        eager, _ = _generate(model, False, late=[5, 6, 7])
        replayed, engine = _generate(model, True, late=[5, 6, 7])
    assert replayed == eager
    graphs = engine.runner.step_graphs
    assert graphs.refused == {}, graphs.refused
    assert graphs.replays >= 10 and set(graphs.graphs) >= {1, 4}, (graphs.replays, sorted(graphs.graphs))


def test_a_sparse_moe_step_stays_eager_and_says_why(caplog):
    model = _model("qwen3_moe")
    with use_backend("native"), caplog.at_level("INFO", logger="lockstep.engine"):
        eager, _ = _generate(model, False)
        replayed, engine = _generate(model, True)
    assert replayed == eager
    graphs = engine.runner.step_graphs
    assert graphs.replays == 0 and graphs.graphs == {} and graphs.refused, graphs.refused
    why = next(iter(graphs.refused.values()))
    assert why.startswith("aten::"), why          # the first op of the routing that a replay cannot make
    assert f"not captured: {why}; it runs eagerly" in caplog.text


def test_a_hooked_module_keeps_its_calls():
    model = _model("llama")
    calls = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda module, args, out: calls.append(1))
    with use_backend("native"):
        replayed, engine = _generate(model, True)
    graphs = engine.runner.step_graphs
    assert graphs.replays == 0 and all("forward hook" in why for why in graphs.refused.values()), graphs.refused
    assert len(calls) == engine._steps


def _scaled_in_new_memory(m: Transformer) -> None:
    m.model.layers[0].mlp.down_proj.weight.data = m.model.layers[0].mlp.down_proj.weight.detach() * 3.0


def _scaled_as_a_new_parameter(m: Transformer) -> None:
    m.model.layers[0].mlp.down_proj.weight = torch.nn.Parameter(m.model.layers[0].mlp.down_proj.weight.detach() * 3.0)


def _hooked(m: Transformer) -> None:
    m.model.layers[1].mlp.down_proj.register_forward_hook(lambda module, args, out: out * 2.0)


@pytest.mark.parametrize("change", [_scaled_in_new_memory, _scaled_as_a_new_parameter, _hooked, "portable"],
                         ids=["new memory", "new parameter", "hook", "portable backend"])
def test_a_change_after_the_capture_has_the_eager_steps_bits(change):
    """After a few replayed steps, a weight given new memory or replaced by a new parameter, a hook
    that changes an output, or another backend: the steps after it have the bits of an eager
    engine changed alike (in-place weight updates, Engine.load_weights and the optimizer's steps,
    keep the graphs)."""
    models = [_model("qwen3"), _model("qwen3")]
    with use_backend("native"):
        engines = [Engine(m, max_num_seqs=4, max_num_batched_tokens=16, block_size=4, cpu_graphs=graphs)
                   for m, graphs in zip(models, (True, False))]
        done = [[], []]
        for e in engines:
            for prompt, params in zip(PROMPTS, PARAMS):
                e.add_request(prompt, params)
        for _ in range(6):
            for e, d in zip(engines, done):
                d += e.step()
        graphs = engines[0].runner.step_graphs
        captured, replays = graphs.captures, graphs.replays
        assert replays > 0
        if change != "portable":
            for m in models:
                change(m)
        with use_backend("portable" if change == "portable" else "native"):
            while engines[0].has_unfinished():
                for e, d in zip(engines, done):
                    d += e.step()
    assert graphs.captures > captured
    a, b = ([(o.request_id, o.token_ids, o.logprobs) for o in d] for d in done)
    assert a == b


def test_ops_are_kept_made_again_or_refused():
    x, i = torch.randn(5, 3), torch.tensor([2, 0])
    out = torch.index_select(x, 0, i)
    entry, why = step_graph.replay_entry(aten.index_select.default, (x, 0, i), {}, out)
    assert why is None and entry[1] is aten.index_select.out and entry[3]["out"] is out
    y = torch.zeros(2, 3)
    entry[1](*entry[2], **{**entry[3], "out": y})
    assert torch.equal(y, out)
    assert step_graph.replay_entry(aten.view.default, (x, [15]), {}, x.view(15)) == (None, None)
    assert step_graph.replay_entry(aten.empty.memory_format, ([3],), {}, torch.empty(3)) == (None, None)
    assert step_graph.replay_entry(aten.add_.Tensor, (x, x), {}, x)[0][1] is aten.add_.Tensor
    assert step_graph.replay_entry(aten._local_scalar_dense.default, (x[0, 0],), {}, 1.0)[1] == \
        "reads a value to the host"
    assert step_graph.replay_entry(aten.nonzero.default, (x,), {}, x)[1] == "has a shape that depends on the data"
    assert step_graph.replay_entry(aten.randn.default, ([2],), {}, x)[1] == "draws random numbers"


def _refusal(model: Transformer, backend: str) -> dict[int, str]:
    with use_backend(backend):
        engine = Engine(model, max_num_seqs=2, block_size=4)
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, temperature=0.0))
    graphs = engine.runner.step_graphs
    assert graphs.replays == 0
    return graphs.refused


def test_a_step_whose_work_a_capture_cannot_see_stays_eager():
    """Triton's launches (its interpreter here) are not kernel calls a capture records, and a module
    that is not lockstep's own may read tensor data in Python, which is no op."""
    assert _refusal(_model("llama"), "triton") == {
        1: "embedding runs on lockstep.backends.triton.embedding, whose kernel launches a capture does not see"}
    model = _model("llama")
    model.model.layers[1].mlp = torch.nn.Sequential()
    why = _refusal(model, "native")[1]
    assert why.startswith("model.layers.1.mlp (Sequential) is not one of lockstep's modules"), why
