"""lockstep: the same bits when an LLM serves and when it trains.

`import lockstep` loads the public ops and the backend registry, nothing more: a backend's kernels
load the first time an op runs on it, and the model, engine, trainer and batch-invariant mode load
the first time one of their names is used.

Modules that moved keep their old import paths (`lockstep.fixed_order`, `lockstep.hf`,
`lockstep.verify`, ...): importing one gives the module at its new place, with a DeprecationWarning.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from . import ops
from .registry import available_backends, current_backend, use_backend

# Public name -> the module that defines it, imported on first use.
_LAZY = {
    "load_model": "model", "logprobs": "model", "Transformer": "model", "ModelConfig": "model",
    "Engine": "engine", "RequestOutput": "engine",
    "SamplingParams": "sampling",
    "batch_invariant": "mode", "enable": "mode", "disable": "mode",
    "patch": "integrations.hf", "unpatch": "integrations.hf",
}


# Old module path -> where the module lives now.
MOVED_MODULES = {
    **{f"lockstep.{m}": f"lockstep.numerics.{m}"
       for m in ("fixed_order", "grad_tree", "exact_math", "second_order", "chunks", "softcap")},
    **{f"lockstep.{m}": f"lockstep.tools.{m}"
       for m in ("verify", "report", "bench", "batch_experiment", "gpu_audit", "backend_bits")},
    "lockstep.hf": "lockstep.integrations.hf",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old module path to the module at its new place: the same module object, so
    state set through either path is one state."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED_MODULES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        new = MOVED_MODULES[module.__name__]
        warnings.warn(f"{module.__name__} has moved to {new}; import it from there", DeprecationWarning,
                      stacklevel=2)
        # The import system returns whatever sys.modules holds under the old name once this returns.
        sys.modules[module.__name__] = importlib.import_module(new)


sys.meta_path.append(_MovedModuleFinder())


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if f"{__name__}.{name}" in MOVED_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'lockstep' has no attribute {name!r}")


__version__ = "0.1.0"
__all__ = ["ops", "use_backend", "current_backend", "available_backends", *_LAZY, "__version__"]
