"""lockstep: the same bits when an LLM serves and when it trains."""

from . import ops
from .backend import available_backends, current_backend, register_loader, use_backend


def _load_portable() -> None:
    from . import portable  # noqa: F401


def _load_eager() -> None:
    from . import eager  # noqa: F401


register_loader("portable", _load_portable)
register_loader("eager", _load_eager)

__version__ = "0.1.0"
__all__ = ["ops", "use_backend", "current_backend", "available_backends", "__version__"]
