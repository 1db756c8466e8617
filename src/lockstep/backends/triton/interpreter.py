"""Triton's interpreter patches triton.language once per launch, not again at every nested call.

The interpreter runs a kernel by replacing triton.language's builtins with numpy-backed stand-ins
(`triton.runtime.interpreter._patch_lang`), for the launch. It also calls `_patch_lang` at every
call of a nested @triton.jit function, inside the launch. There that call finds no builtin left to
replace (the launch replaced them all), and sets the tensor class's `__bool__`, `__index__` and `T`
and the language's `range`, `reduce` and the like to new closures that do what the launch's
already do. So it changes nothing a kernel computes, but it walks every member of the language
each time, and each rebinding of a class attribute invalidates CPython's attribute cache for that
class, which every tensor operation after it then refills. lockstep's kernels make thousands of
such calls in a launch: `dot`, `cast_out`, the attention kernels' tile and mask helpers
(docs/adr/0029).

`patch_language_once` wraps `_patch_lang`: a call whose function sees only language modules that
are already patched (every module of `triton.language` or `triton.language.core` in its globals
has a stand-in for `load`) returns without patching. A launch's own call, and a nested function's
that sees a module the launch did not patch, go to the interpreter as before.

The interpreter also asks `_get_np_dtype` for the numpy dtype of a Triton dtype at nearly every
operation, and each call builds its table of every dtype anew. `cache_dtype_lookup` keeps each
answer: a function of the dtype alone (a block's, of its element type's), so the same values come
back.
"""

from __future__ import annotations

import triton.language as tl

_MARK = "_lockstep_patches_once"


def _languages_patched(fn) -> bool:
    """Whether every triton.language module that `fn` can see already has the interpreter's
    stand-ins (a module the interpreter has patched no longer holds the builtin `load`)."""
    langs = [v for v in getattr(fn, "__globals__", {}).values() if v is tl or v is tl.core]
    return bool(langs) and not any(tl.core.is_builtin(getattr(lang, "load", None)) for lang in langs)


def patch_language_once() -> bool:
    """Install the wrapper in triton.runtime.interpreter (once). False where that module has no
    `_patch_lang` to wrap: then nothing changes."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True
    # Newer interpreters return a scope that the launch restores; a call that patches nothing
    # returns an empty one.
    scope = getattr(interpreter, "_LangPatchScope", None)

    def patch_lang(fn):
        if _languages_patched(fn):
            return scope() if scope is not None else None
        return original(fn)

    setattr(patch_lang, _MARK, True)
    patch_lang.original = original
    interpreter._patch_lang = patch_lang
    return True


def cache_dtype_lookup() -> bool:
    """Install a caching `_get_np_dtype` in triton.runtime.interpreter (once). False where that
    module has none to wrap: then nothing changes."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True
    found: dict = {}

    def get_np_dtype(tt_dtype):
        # A block's answer is its element type's (the interpreter's own rule); block types do not hash.
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        try:
            return found[key]
        except KeyError:
            answer = found[key] = original(key)
            return answer
        except TypeError:                   # a pointer type, which does not hash: the interpreter's answer
            return original(tt_dtype)

    setattr(get_np_dtype, _MARK, True)
    get_np_dtype.original = original
    interpreter._get_np_dtype = get_np_dtype
    return True
