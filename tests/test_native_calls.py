"""lockstep.backends.native.calls: the kernels called through a compiled extension instead of
ctypes, with ctypes' bits, its argument checks, and ctypes where the extension cannot be built."""

from __future__ import annotations

import ctypes
import logging
import threading
import time

import pytest
import torch

from lockstep.backends.native import bits, build, calls


def test_the_kernels_are_called_through_the_extension_with_ctypes_bits():
    """Every section of the native digest (GEMMs, rows, rope, SiLU, attention forward and backward,
    the LM head's rows, float64), on 1 and 3 threads: the same bits through either call path."""
    lib = build.library()
    assert isinstance(lib, calls.Calls)
    assert set(build.SIGNATURES) <= set(vars(lib))
    for threads in (1, 3):
        assert bits.digests(lib, build.isa(), threads) == bits.digests(lib.ctypes_library, build.isa(), threads)
    assert lib.ls_abi_version() == build.ABI_VERSION           # what the extension does not hold: ctypes'


def test_a_call_with_bad_arguments_is_refused_by_name():
    lib = build.library()
    with pytest.raises(TypeError, match=r"^ls_rope: expected 11 arguments, got 2$"):
        lib.ls_rope(1, 2)
    with pytest.raises(TypeError):
        lib.ls_rope("3", 1, 8, None, None, None, None, 0, 0, 0, 1)
    with pytest.raises(OverflowError, match="out of the C int's range"):
        lib.ls_cpu_supports(2 ** 40)
    assert lib.ls_rope(-1, 1, 8, None, None, None, None, 0, 0, 0, 1) == -1   # the kernel's own refusal


def test_a_pointer_is_an_int_none_or_a_c_void_p_and_nothing_else():
    lib = build.library()
    x = torch.ones(8)
    y = torch.empty(8)
    args = (8, x.data_ptr(), x.data_ptr(), None, y.data_ptr(), None, 0, 2, 0, 1)    # silu_mul, fp32, scalar
    assert lib.ls_silu(*args) == 0
    as_void = [ctypes.c_void_p(a) if isinstance(a, int) and i in (1, 2, 4) else a for i, a in enumerate(args)]
    assert lib.ls_silu(*as_void) == 0
    with pytest.raises(TypeError, match="a pointer argument must be an int, None or a ctypes.c_void_p, not c_long"):
        lib.ls_silu(8, ctypes.c_int64(x.data_ptr()), *args[2:])


def test_other_threads_run_while_a_kernel_does():
    """The extension lets go of the interpreter around a kernel, as ctypes did: a thread that keeps
    taking timestamps meanwhile never pauses for as long as the kernel runs (held, it would pause for
    all of it)."""
    lib = build.library()
    rows = 1536
    a, b, out = torch.ones(rows, 2048), torch.ones(2048, 2048), torch.empty(rows, 2048)

    def gemm() -> float:
        start = time.perf_counter()
        assert lib.ls_gemm_nt(1, rows, 2048, 2048, a.data_ptr(), 2048, 0, b.data_ptr(), 2048, 0, out.data_ptr(),
                              2048, 0, None, 0, 0, 1, build.isa(), 1) == 0
        return time.perf_counter() - start

    alone = min(gemm(), gemm())
    stamps, done = [], threading.Event()

    def tick():
        while not done.is_set():
            stamps.append(time.perf_counter())

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        gemm()
    finally:
        done.set()
        ticker.join()
    assert torch.equal(out, torch.full((rows, 2048), 2048.0))
    longest = max(later - earlier for earlier, later in zip(stamps, stamps[1:]))
    assert longest < alone / 2, (longest, alone)


def test_without_python_headers_the_calls_stay_ctypes(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("LOCKSTEP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calls, "_python_include", lambda: str(tmp_path / "no-headers"))
    lib = build.library().ctypes_library
    with caplog.at_level(logging.WARNING, logger="lockstep"):
        assert calls.bind(lib, build.SIGNATURES, build.compiler(), build.cache_dir(), build.compiler_version(build.compiler())) is lib
    assert "the native kernels are called through ctypes" in caplog.text and "no Python.h in" in caplog.text


def test_ctypes_calls_can_be_asked_for_and_a_bad_choice_is_named(monkeypatch):
    lib = build.library().ctypes_library
    monkeypatch.setenv("LOCKSTEP_NATIVE_CALLS", "ctypes")
    assert calls.bind(lib, build.SIGNATURES, build.compiler(), build.cache_dir(), build.compiler_version(build.compiler())) is lib
    monkeypatch.setenv("LOCKSTEP_NATIVE_CALLS", "cffi")
    with pytest.raises(ValueError, match=r"^LOCKSTEP_NATIVE_CALLS: expected 'extension' or 'ctypes', got 'cffi'$"):
        calls.bind(lib, build.SIGNATURES, build.compiler(), build.cache_dir(), build.compiler_version(build.compiler()))
