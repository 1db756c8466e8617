"""The contract as data: contract.toml, read here (docs/contract.md explains every number)."""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from importlib import resources

import torch

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64,
               "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
               "float64": torch.float64}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPE_NAMES[name.strip()]
    except KeyError:
        raise ValueError(f"dtype: unknown dtype {name!r}; expected one of fp32, bf16, fp16, fp64") from None


@functools.cache
def load() -> dict:
    """The raw contract table."""
    text = resources.files("lockstep").joinpath("contract.toml").read_text()
    return tomllib.loads(text)


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float

    def excess(self, got: torch.Tensor, ref: torch.Tensor) -> float:
        """max(|got - ref| - (atol + rtol |ref|)); <= 0 means within the contract. NaN counts as a miss."""
        got64, ref64 = got.detach().double(), ref.detach().double()
        both_nan = got64.isnan() & ref64.isnan()
        diff = (got64 - ref64).abs()
        allowed = self.atol + self.rtol * ref64.abs()
        excess = torch.where(both_nan, torch.full_like(diff, -1.0), diff - allowed)
        excess = torch.where(excess.isnan(), torch.full_like(excess, float("inf")), excess)
        return float(excess.max()) if excess.numel() else -1.0


def op_entry(op: str) -> dict:
    """contract.toml's [ops] entry of `op`: its accuracy class and the harness check of its sweeps."""
    try:
        return dict(load()["ops"][op])
    except KeyError:
        raise ValueError(f"op: {op!r} has no entry in contract.toml [ops]; expected one of "
                         f"{sorted(load()['ops'])}") from None


def op_class(op: str) -> str:
    return op_entry(op)["class"]


def promises_thread_invariance(backend: str) -> bool:
    """Whether `backend`'s bits are promised not to change with the CPU thread count (contract.toml
    [backends.B] thread_invariant, true unless it says otherwise; true for names it has no entry for)."""
    return bool(load()["backends"].get(backend, {}).get("thread_invariant", True))


def backend_ops(backend: str) -> list[str]:
    """The ops `backend` implements, by contract.toml's [backends] table."""
    try:
        return list(load()["backends"][backend]["ops"])
    except KeyError:
        raise ValueError(f"backend: {backend!r} has no entry in contract.toml [backends]; expected one of "
                         f"{sorted(load()['backends'])}") from None


def tolerance(op: str, dtype: torch.dtype, kind: str = "forward") -> Tolerance:
    """The contract's tolerance for `op` at `dtype`; kind is "forward" or "gradient".

    float64 is held to the float32 numbers."""
    if kind not in ("forward", "gradient"):
        raise ValueError(f"kind: expected 'forward' or 'gradient', got {kind!r}")
    name = dtype_name(torch.float32 if dtype == torch.float64 else dtype)
    atol, rtol = load()[kind][op_class(op)][name]
    return Tolerance(float(atol), float(rtol))


def relative_to_pytorch() -> tuple[float, int]:
    table = load()["relative_to_pytorch"]
    return float(table["factor"]), int(table["floor_ulps"])


def ulp(dtype: torch.dtype, magnitude: float) -> float:
    """One unit in the last place of `dtype` at `magnitude`."""
    info = torch.finfo(dtype)
    if magnitude <= info.tiny or magnitude != magnitude:
        return float(info.tiny)
    exponent = torch.floor(torch.log2(torch.tensor(float(magnitude), dtype=torch.float64)))
    return float(2.0 ** exponent) * float(info.eps)


def chain_tolerance(dtype: torch.dtype) -> float:
    """Max |dlogprob| allowed between lockstep and a float64 (or transformers) model (docs/contract.md, section 4)."""
    return float(load()["chain"]["max_abs_dlogp_vs_float64"][dtype_name(dtype)])
