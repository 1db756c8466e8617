"""A static decode step's forward captured on the CPU and replayed (ADR 0043).

On the CPU, a decode step's host work is the Python around each kernel: the op's checks, its
dispatch, its allocations, a few microseconds per call and about ten calls per layer. A step of a
bucket (engine.model_runner.DecodeBuffers) runs on the same buffers each time: its metadata in the
bucket's flat buffer, its keys and values in the same cache, its weights in the same parameters.
So once the bucket has run eagerly, its next step is captured while it runs: every native kernel
call is recorded with its arguments (backends.native.program), and every aten op between them is
watched (`_Capture`). An aten op that computes is kept, to be made again into the same output
(its `.out` form) or in place; an allocation or a view needs nothing more than its memory, which
the graph keeps. Later steps of the bucket replay the calls in order: the same kernels on the same
memory, so the same bits, without the Python.

A step is not captured, and the bucket stays eager, when any op of its forward reads a value to the
host, makes a tensor of Python values, draws random numbers, has a shape that depends on the data,
is not an aten op (a collective of tensor parallelism), or has no `.out` form; nor when a module
of the model has a forward hook (a replay would not call it), is not lockstep's own (a read of
tensor data that Python makes, `tolist` or `numpy`, is no op, so a capture would not see it;
lockstep's decode forward makes none, tests/test_model_runner.py), or autocast is on. A replay first
checks that every parameter and the cache still have their memory (a weight load into new tensors
captures the bucket again), and that the context is the capture's: the same implementation
of every op, autocast, inference mode and hooks (a hook added later has the bucket run eagerly)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn.modules import module as torch_module
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger("lockstep.engine")
aten = torch.ops.aten

ALLOCATIONS = frozenset({aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
                         aten.new_empty.default, aten.new_empty_strided.default})
REFUSED = {aten._local_scalar_dense.default: "reads a value to the host",
           aten.lift_fresh.default: "makes a tensor of Python values",
           aten.lift_fresh_copy.default: "makes a tensor of Python values"}
REFUSED_TAGS = {torch.Tag.nondeterministic_seeded: "draws random numbers",
                torch.Tag.dynamic_output_shape: "has a shape that depends on the data",
                torch.Tag.data_dependent_output: "reads a value to the host"}


def _writes(schema) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


# Arguments that an out= form takes from its output tensor instead (a factory's, `_to_copy`'s).
TENSOR_OPTIONS = frozenset({"dtype", "layout", "device", "pin_memory"})


def _out_argument(func) -> tuple[object, str, frozenset[str]] | None:
    """func's out= overload (`Tensor_out` for `Tensor`, else `out`), the name of its output
    argument and the keyword arguments it does not take (tensor options, which the output
    carries), for an op of one tensor output whose out= form takes its other arguments."""
    inputs = [a.name for a in func._schema.arguments]
    for name in (f"{func._overloadname}_out", "out"):
        overload = getattr(func.overloadpacket, name, None)
        if overload is None:
            continue
        written = [a.name for a in overload._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        rest = [a.name for a in overload._schema.arguments if a.name not in written]
        dropped = frozenset(inputs) - frozenset(rest)
        if len(written) == 1 and [n for n in inputs if n not in dropped] == rest and dropped <= TENSOR_OPTIONS:
            return overload, written[0], dropped
    return None


def _integer_index(func, args: tuple) -> bool:
    """Whether `func` is indexing by integer tensors, whose output's shape is the indices': only a
    boolean index makes it depend on the data."""
    return func is aten.index.Tensor and all(i is None or not (i.dtype == torch.bool or i.dtype == torch.uint8)
                                             for i in args[1])


def replay_entry(func, args: tuple, kwargs: dict, out) -> tuple[tuple | None, str | None]:
    """(the entry that makes `func`'s call again, or None where it needs none; why it cannot be
    replayed, or None)."""
    if func.namespace != "aten":
        return None, "is not an aten op"
    if func in REFUSED:
        return None, REFUSED[func]
    for tag, why in REFUSED_TAGS.items():
        if tag in func.tags and not _integer_index(func, args):
            return None, why
    if func in ALLOCATIONS:
        return None, None
    schema = func._schema
    if _writes(schema):                                   # in place, or an out= form: made again as is
        return ("aten", func, args, kwargs), None
    if all(r.alias_info is not None for r in schema.returns):    # a view: its memory is its base's
        return None, None
    if not isinstance(out, Tensor):
        return None, "has outputs other than one tensor"
    found = _out_argument(func)
    if found is None:
        return None, "has no .out form"
    overload, name, dropped = found
    return ("aten", overload, args, {**{k: v for k, v in kwargs.items() if k not in dropped}, name: out}), None


class _Capture(TorchDispatchMode):
    """Watches the aten ops of a capture: appends each op that computes to `entries` (beside the
    recorded kernel calls) and keeps every tensor they touch alive; `refused` names the first op
    that cannot be replayed."""

    def __init__(self, entries: list[tuple]):
        super().__init__()
        self.entries, self.keep, self.refused = entries, [], None

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing a capture runs is compiled. Wrapping __torch_dispatch__ to keep Dynamo out of it
        # (PyTorch's default) imports torch._dynamo on the first capture of a process: seconds of CPU
        # for every server that captures a step.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.keep.append((args, kwargs, out))
        if self.refused is None:
            entry, why = replay_entry(func, args, kwargs, out)
            if why is not None:
                self.refused = f"{func.name()} {why}"
            elif entry is not None:
                self.entries.append(entry)
        return out


class StepGraph:
    """The recorded forward of one bucket: `replay()` makes its calls again and returns the output
    tensor the capture returned, which each replay overwrites."""

    def __init__(self, entries: list[tuple], keep: list, out: Tensor, model: nn.Module, cache, context: tuple):
        self.entries, self.keep, self.out, self.context = entries, keep, out, context
        modules = list(model.modules())
        # What the forward reads that outlives the step, watched for a change at every replay: each
        # module's parameters, buffers and submodules (by identity), the tensors' addresses, and
        # whether a module has gained a hook or a forward of its own.
        self.members = [(d, name, value) for m in modules for d in (m._parameters, m._buffers, m._modules)
                        for name, value in d.items()]
        self.tensors = [(t, t.data_ptr()) for _, _, t in self.members if isinstance(t, Tensor)]
        self.cache_lists = (cache.k, cache.v)
        self.cache = [(c, i, t, t.data_ptr()) for c in self.cache_lists for i, t in enumerate(c)]
        self.hooks = [(m._forward_hooks, m._forward_pre_hooks, m.__dict__) for m in modules]

    def valid(self, cache, context: tuple) -> bool:
        """Whether a replay stands for the forward now: the same parameters, buffers, submodules and
        cache tensors, at the same addresses, no hook or instance forward added, and the same
        context (`_context`: the ops' implementations, autocast, inference mode, global hooks)."""
        if context != self.context or cache.k is not self.cache_lists[0] or cache.v is not self.cache_lists[1]:
            return False
        return (all(d.get(name) is value for d, name, value in self.members)
                and all(t.data_ptr() == address for t, address in self.tensors)
                and all(c[i] is t and t.data_ptr() == address for c, i, t, address in self.cache)
                and not any(hooks or pre or "forward" in attrs for hooks, pre, attrs in self.hooks))

    def replay(self) -> Tensor:
        for entry in self.entries:
            if entry[0] == "native":
                _, fn, args, returned = entry
                got = fn(*args)
                if got != returned:
                    raise RuntimeError(f"a replayed step's kernel call returned {got}, where its capture returned "
                                       f"{returned}")
            else:
                entry[1](*entry[2], **entry[3])
        return self.out


def _global_hooks() -> bool:
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)


def hooked(model: nn.Module) -> bool:
    """Whether a call of `model` would run hooks that a replay would not."""
    return _global_hooks() or any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def capture(forward: Callable[[], Tensor], model: nn.Module, cache,
            context: tuple | None) -> tuple[Tensor, StepGraph | None, str | None]:
    """Runs `forward` (a static decode step's, whose tensors stay where they are) and records it:
    (its output, the graph that replays it or None, why not). cache: the KVCache the step reads
    and writes; context: `_context(model)`."""
    why = _unrecordable(model, context[0]) if context is not None else \
        "an op of the registry has no implementation here"
    if why is None:
        try:
            from ..backends.native import program
        except ImportError as e:
            why = f"the native backend is not available ({e})"
    if why is not None:
        return forward(), None, why

    with program.recording() as recording, _Capture(recording.entries) as watched:
        out = forward()
    if watched.refused is not None:
        return out, None, watched.refused
    if not isinstance(out, Tensor):
        return out, None, "the forward returned no tensor"
    return out, StepGraph(recording.entries, watched.keep, out, model, cache, context), None


def _context(model: nn.Module) -> tuple | None:
    """What a recorded step stands for besides the model's and the cache's tensors: each op's
    implementation (the backend in use, an op recorder's wrappers), autocast, inference mode and
    whether global hooks would run; None where an op of the registry has no implementation."""
    from ..registry import OPS, resolve

    try:
        impls = tuple(resolve(op, torch.device("cpu")) for op in OPS)
    except (NotImplementedError, ImportError):
        return None
    return impls, torch.is_autocast_enabled("cpu"), torch.is_inference_mode_enabled(), _global_hooks()


# The backends whose work a capture sees: the native kernels' calls, and aten ops.
RECORDABLE = ("lockstep.backends.native", "lockstep.backends.portable", "lockstep.backends.eager",
              "lockstep.backends.reference")


def _unrecordable(model: nn.Module, impls: tuple) -> str | None:
    """Why a step of `model` on the CPU cannot be recorded, or None; impls: what each op of the
    registry resolves to (`_context`)."""
    from ..registry import OPS

    if hooked(model):
        return "a module of the model has a forward hook, which a replay would not call"
    stranger = _not_locksteps(model)
    if stranger is not None:
        return (f"{stranger} is not one of lockstep's modules, whose decode forward reads no tensor data to the "
                "host (a read that Python makes, tolist or numpy, is not an op a capture sees)")
    if torch.is_autocast_enabled("cpu"):
        return "autocast is on"
    for op, impl in zip(OPS, impls):
        if not impl.__module__.startswith(RECORDABLE):
            return f"{op} runs on {impl.__module__}, whose kernel launches a capture does not see"
    return None


def _not_locksteps(model: nn.Module) -> str | None:
    """The first module of `model` that is not lockstep's own, with lockstep's forward (a torch
    container aside), or one whose forward an instance replaces; None if there is none."""
    for name, m in model.named_modules():
        own = type(m).__module__.startswith("lockstep.") or type(m) in _CONTAINERS
        if not own or "forward" in m.__dict__ or "forward_cached" in m.__dict__:
            return f"{name or 'the model'} ({type(m).__name__})"
    return None


_CONTAINERS = (nn.Module, nn.ModuleList, nn.ModuleDict)


class StepGraphs:
    """The engine's captured decode steps, one graph per bucket of rows: a bucket's first step runs
    eagerly (it builds what a process builds once, rope's table among them), its second is captured
    while it runs, and later ones replay. A bucket whose step cannot be replayed stays eager until
    the context changes (`_context`); one whose memory or context changed is captured again."""

    def __init__(self) -> None:
        self.graphs: dict[int, StepGraph] = {}
        self.refused: dict[int, str] = {}
        self._refused_in: dict[int, tuple | None] = {}
        self._seen: set[int] = set()
        self.captures = self.replays = 0

    def forward(self, rows: int, run: Callable[[], Tensor], run_afresh: Callable[[], Tensor], model: nn.Module,
                cache) -> Tensor:
        """The output of a static decode step of `rows` rows: `run()` (the forward), replayed where
        the bucket has a graph. `run_afresh()` is the same forward with nothing remembered from
        this step's earlier calls (rope's gathered angles), so that a capture records their making.
        cache: the KVCache the step reads and writes."""
        context = _context(model)
        graph = self.graphs.get(rows)
        if graph is not None and graph.valid(cache, context):
            self.replays += 1
            return graph.replay()
        first = graph is None and rows not in self.refused and rows not in self._seen
        if first or (rows in self.refused and self._refused_in[rows] == context):
            self._seen.add(rows)
            return run()
        out, graph, why = capture(run_afresh, model, cache, context)
        self.captures += 1
        if graph is None:
            self.graphs.pop(rows, None)
            self.refused[rows], self._refused_in[rows] = why, context
            log.info("lockstep engine: the decode step of %d rows is not captured: %s; it runs eagerly", rows, why)
        else:
            self.graphs[rows] = graph
            self.refused.pop(rows, None)
        return out
