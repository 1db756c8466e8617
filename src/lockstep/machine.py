"""What a process computes with: the backend its ops resolve to, the CPU's instruction set or the
GPU's model, and the torch and Triton versions. Processes that must give the same bits (an RL
trainer's ranks, and the trainer and its rollout servers) compare these before they start."""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

# The order in which fields are compared, and a mismatch reported: the first one that differs.
FIELDS = ("backend", "device", "isa", "gpu", "torch", "triton")


def resolved_backend(backend: str, device: torch.device | str = "cpu") -> str:
    """The backend that `backend` runs on `device`: "auto" is the native CPU backend where its kernels
    load (else portable) and Triton on a GPU, as lockstep.registry resolves it."""
    device = torch.device(device)
    if backend != "auto":
        return backend
    if device.type == "cuda":
        return "triton"
    from .registry import cpu_backend

    return cpu_backend()


def fingerprint(backend: str = "auto", device: torch.device | str = "cpu") -> dict[str, str | None]:
    """This process's fingerprint for ops on `backend` and `device`: FIELDS, each a string or None
    where it does not apply (no GPU; no native kernels, so no instruction set; Triton not installed)."""
    device = torch.device(device)
    name = resolved_backend(backend, device)
    isa = None
    if name == "native":
        from .backends.native.build import isa_name

        isa = isa_name()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    return {"backend": name, "device": device.type, "isa": isa, "gpu": gpu, "torch": torch.__version__,
            "triton": triton}


def differences(ours: dict, theirs: dict) -> list[tuple[str, object, object]]:
    """(field, our value, their value) for every field of FIELDS where the two fingerprints differ."""
    return [(k, ours.get(k), theirs.get(k)) for k in FIELDS if ours.get(k) != theirs.get(k)]


class FingerprintMismatch(ValueError):
    """Two processes that must give the same bits (a trainer's ranks, a trainer and its rollout
    servers) compute with another backend, machine or library version."""


def in_words(diff: list[tuple[str, object, object]], ours: str, theirs: str) -> str:
    """`differences` in words: "isa: the trainer has 'avx512', the server 'avx2'; ..."."""
    return "; ".join(f"{field}: {ours} has {a!r}, {theirs} {b!r}" for field, a, b in diff)


def check_ranks(ours: Callable[[], dict], accept_mismatch: bool = False) -> list[dict]:
    """Every rank's fingerprint (`ours()`, computed on each rank), gathered: one per rank of the
    default process group, [ours()] without one. Each is compared with rank 0's; a rank that
    differs raises FingerprintMismatch on every rank at once, naming the rank and the field, so that
    no rank is left waiting in a collective (with accept_mismatch rank 0 logs it instead). A rank
    whose fingerprint fails raises RuntimeError on every rank, naming it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [ours()]
    try:
        mine: tuple = ("ok", ours())
    except Exception as e:              # the other ranks are about to wait for this one
        mine = ("error", f"{type(e).__name__}: {e}")
    found: list = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    failed = [(rank, text) for rank, (kind, text) in enumerate(found) if kind == "error"]
    if failed:
        raise RuntimeError(f"trainer rank {failed[0][0]} could not tell what it computes with: {failed[0][1]}")
    prints = [fp for _, fp in found]
    for rank, theirs in enumerate(prints[1:], 1):
        diff = differences(prints[0], theirs)
        if not diff:
            continue
        words = in_words(diff, "rank 0", f"rank {rank}")
        if not accept_mismatch:
            raise FingerprintMismatch(f"trainer rank {rank} computes differently from rank 0 ({words}); the ranks' "
                                      "gradients would not add up to one process's bits. Pass --accept-mismatch "
                                      "to train anyway")
        if dist.get_rank() == 0:
            logging.getLogger("lockstep.rl").warning("lockstep rl: trainer rank %d differs from rank 0 (%s); "
                                                     "training anyway (--accept-mismatch)", rank, words)
    return prints
