"""lockstep: the same bits when an LLM serves and when it trains."""

from . import batch_invariant, ops
from .backend import available_backends, current_backend, register_loader, use_backend


def _load_portable() -> None:
    from . import portable  # noqa: F401


def _load_eager() -> None:
    from . import eager  # noqa: F401


def _load_triton() -> None:
    """Import the Triton kernels when triton is installed. Without a CUDA device they run under
    Triton's interpreter, which must be chosen before triton is imported."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from . import triton_ops  # noqa: F401


def _load_reference() -> None:
    from . import reference_backend  # noqa: F401


register_loader("portable", _load_portable)
register_loader("eager", _load_eager)
register_loader("reference", _load_reference)
register_loader("triton", _load_triton)


def __getattr__(name: str):
    # The model side imports lazily, so `import lockstep` stays light for op-only users.
    if name in ("load_model", "logprobs", "Transformer", "ModelConfig"):
        from . import model

        return getattr(model, name)
    if name in ("Engine", "RequestOutput"):
        from . import engine

        return getattr(engine, name)
    if name in ("enable", "disable"):
        return getattr(batch_invariant, name)
    if name in ("patch", "unpatch"):
        from . import hf

        return getattr(hf, name)
    if name == "SamplingParams":
        from .sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'lockstep' has no attribute {name!r}")


__version__ = "0.1.0"
__all__ = ["ops", "use_backend", "current_backend", "available_backends", "load_model", "logprobs",
           "Transformer", "ModelConfig", "Engine", "SamplingParams", "RequestOutput", "batch_invariant", "enable", "disable",
           "patch", "unpatch", "__version__"]
