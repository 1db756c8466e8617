"""lockstep's inference engine, split the way inference engines are built:

    engine.py         the loop: add_request, step, stream, generate, load_weights
    scheduler.py      who runs in the next step, and how many tokens; preemption
    block_manager.py  the KV cache's blocks: reference counts, prefix sharing by hashed full blocks
    model_runner.py   one step's cache inputs (lockstep.paged_cache.build_step), the forward, the draw
    sequence.py       a completion's state, and the RequestOutput handed back
    requests.py       the check of a request against the engine's RequestLimits (lockstep serve's too)
"""

from .engine import Engine
from .sequence import RequestOutput

__all__ = ["Engine", "RequestOutput"]
