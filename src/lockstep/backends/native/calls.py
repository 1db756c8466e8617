"""The kernels' entry points called from Python through a small CPython extension.

A ctypes call converts each argument through ctypes' type objects: about 3.8 us for a call of 20
arguments on the 2-core Xeon, where a METH_FASTCALL function of a compiled extension takes 0.2 us,
and an engine's decode step makes about 15 kernel calls per layer. So beside the kernel library
`build.library()` compiles a module generated from build.SIGNATURES: one function per entry
point that converts its arguments (an int64, an int, an address or None, a float) as ctypes would
and calls the library's own function through its address. The same C functions with the same
arguments: the same bits. The module is cached like the library, by its source, the compiler and
the Python it was built for.

Where it cannot be built (no Python headers, say) the calls stay ctypes', after one line on stderr;
LOCKSTEP_NATIVE_CALLS=ctypes asks for ctypes' calls.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType


MODULE = "_lockstep_calls"
_C_TYPES = {"q": "int64_t", "i": "int", "p": "void *", "f": "float"}
_CONVERT = {"q": "as_int64", "i": "as_int", "p": "as_pointer", "f": "as_float"}

_PROLOGUE = r"""#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>

static int as_int64(PyObject *o, int64_t *v) {
    *v = (int64_t)PyLong_AsLongLong(o);
    return *v == -1 && PyErr_Occurred() ? -1 : 0;
}
static int as_int(PyObject *o, int *v) {
    long long x = PyLong_AsLongLong(o);
    if (x == -1 && PyErr_Occurred()) return -1;
    if (x < INT_MIN || x > INT_MAX) {
        PyErr_SetString(PyExc_OverflowError, "an int argument is out of the C int's range");
        return -1;
    }
    *v = (int)x;
    return 0;
}
static PyObject *void_pointer_type; /* ctypes.c_void_p, given to bind */
static int as_pointer(PyObject *o, void **v) {
    if (o == Py_None) { *v = NULL; return 0; }
    if (!PyLong_Check(o)) { /* a ctypes.c_void_p, as ctypes takes one: its address; nothing else */
        if (!void_pointer_type || !PyObject_TypeCheck(o, (PyTypeObject *)void_pointer_type)) {
            PyErr_Format(PyExc_TypeError, "a pointer argument must be an int, None or a ctypes.c_void_p, not %s",
                         Py_TYPE(o)->tp_name);
            return -1;
        }
        PyObject *value = PyObject_GetAttrString(o, "value");
        if (!value) return -1;
        int failed = 0;
        if (value == Py_None) *v = NULL;
        else { *v = PyLong_AsVoidPtr(value); failed = *v == NULL && PyErr_Occurred(); }
        Py_DECREF(value);
        return failed ? -1 : 0;
    }
    *v = PyLong_AsVoidPtr(o);
    return *v == NULL && PyErr_Occurred() ? -1 : 0;
}
static int as_float(PyObject *o, float *v) {
    double x = PyFloat_AsDouble(o);
    if (x == -1.0 && PyErr_Occurred()) return -1;
    *v = (float)x;
    return 0;
}
static PyObject *wrong_count(const char *name, Py_ssize_t want, Py_ssize_t got) {
    PyErr_Format(PyExc_TypeError, "%s: expected %zd arguments, got %zd", name, want, got);
    return NULL;
}
"""


def source(signatures: dict[str, tuple[str, str]]) -> str:
    """The extension's C source: a function per entry point of `signatures` (build.SIGNATURES), and
    `bind`, which takes {name: address} from the loaded library."""
    parts = [_PROLOGUE]
    for name, (args, result) in signatures.items():
        c_result = "void" if result == "v" else _C_TYPES[result]
        params = ", ".join(_C_TYPES[code] for code in args) or "void"
        parts.append(f"typedef {c_result} (*{name}_t)({params});\nstatic {name}_t {name}_at;\n")
        lines = [f"static PyObject *call_{name}(PyObject *self, PyObject *const *a, Py_ssize_t n) {{",
                 f"    if (n != {len(args)}) return wrong_count(\"{name}\", {len(args)}, n);"]
        lines += [f"    {_C_TYPES[code]} x{i};" for i, code in enumerate(args)]
        if args:
            checks = " || ".join(f"{_CONVERT[code]}(a[{i}], &x{i})" for i, code in enumerate(args))
            lines.append(f"    if ({checks}) return NULL;")
        call = f"{name}_at({', '.join(f'x{i}' for i in range(len(args)))})"
        # The kernels touch no Python object: other threads (a server's HTTP loop) run meanwhile,
        # as they did beside ctypes' calls.
        if result == "v":
            lines += ["    Py_BEGIN_ALLOW_THREADS", f"    {call};", "    Py_END_ALLOW_THREADS", "    Py_RETURN_NONE;"]
        else:
            lines += [f"    {_C_TYPES[result]} r;", "    Py_BEGIN_ALLOW_THREADS", f"    r = {call};",
                      "    Py_END_ALLOW_THREADS", "    return PyLong_FromLongLong((long long)r);"]
        parts.append("\n".join(lines) + "\n}\n")
    binds = "\n".join(f"    if (!({name}_at = ({name}_t)address(table, \"{name}\"))) return NULL;" for name in signatures)
    parts.append(r"""static void *address(PyObject *table, const char *name) {
    PyObject *value = PyDict_GetItemString(table, name);
    if (!value) { PyErr_Format(PyExc_KeyError, "bind: no address for %s", name); return NULL; }
    return PyLong_AsVoidPtr(value);
}
static PyObject *bind(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    if (n != 2 || !PyDict_Check(a[0]) || !PyType_Check(a[1])) {
        PyErr_SetString(PyExc_TypeError, "bind: expected a dict of addresses and ctypes.c_void_p");
        return NULL;
    }
    PyObject *table = a[0];
    Py_INCREF(a[1]);
    Py_XSETREF(void_pointer_type, a[1]);
""" + binds + "\n    Py_RETURN_NONE;\n}\n")
    methods = "\n".join(f"    {{\"{name}\", (PyCFunction)(void (*)(void))call_{name}, METH_FASTCALL, NULL}},"
                        for name in signatures)
    parts.append(f"""static PyMethodDef methods[] = {{
    {{"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL, NULL}},
{methods}
    {{NULL, NULL, 0, NULL}}
}};
static struct PyModuleDef module = {{PyModuleDef_HEAD_INIT, "{MODULE}", NULL, -1, methods}};
PyMODINIT_FUNC PyInit_{MODULE}(void) {{ return PyModule_Create(&module); }}
""")
    return "\n".join(parts)


class Calls:
    """The kernel library as `build.library()` hands it out: the entry points the extension was
    made for as its functions, anything else from the ctypes library (`ctypes_library`)."""

    def __init__(self, module: ModuleType, ctypes_library: ctypes.CDLL, names: list[str]):
        self.ctypes_library = ctypes_library
        for name in names:
            setattr(self, name, getattr(module, name))

    def __getattr__(self, name: str):
        return getattr(self.ctypes_library, name)


def _python_include() -> str:
    return sysconfig.get_paths()["include"]


def _build(cc: list[str], code: str, folder: Path, version: str, rebuild: bool = False) -> Path:
    """The extension compiled from `code` by `cc` (which says it is `version`), from the cache
    `folder` or compiled into it (`rebuild`: over a file there that does not load), or into a
    folder of this process's own where `folder` cannot be written."""
    include = _python_include()
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    flags = ["-O2", "-shared", "-fPIC", f"-I{include}"] + (["-undefined", "dynamic_lookup"]
                                                           if sys.platform == "darwin" else [])
    key = hashlib.sha256("\0".join([code, *cc, *flags, suffix, version]).encode()).hexdigest()[:16]
    target = folder / f"calls-{key}{suffix}"
    if target.exists() and not rebuild:
        return target
    if not Path(include, "Python.h").exists():
        raise OSError(f"no Python.h in {include} (the Python headers: python3-dev on Debian)")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        probe = tempfile.TemporaryDirectory(dir=target.parent)
    except OSError:          # a cache folder this user cannot write: built for this process alone
        target = Path(tempfile.mkdtemp(prefix="lockstep-calls-")) / target.name
        atexit.register(shutil.rmtree, target.parent, ignore_errors=True)
        probe = tempfile.TemporaryDirectory(dir=target.parent)
    with probe as scratch:
        c_file, built = Path(scratch, f"{MODULE}.c"), Path(scratch, f"{MODULE}{suffix}")
        c_file.write_text(code)
        done = subprocess.run([*cc, *flags, "-o", str(built), str(c_file)], capture_output=True, text=True)
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines()
            raise OSError(next((x for x in lines if "error" in x.lower()), lines[0] if lines else "(no message)"))
        os.chmod(built, 0o755)
        with open(built, "rb") as f:
            os.fsync(f.fileno())    # a crash must not leave a short file under the final name
        os.replace(built, target)   # a process never loads a partial file
    return target


def _load(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def bind(lib: ctypes.CDLL, signatures: dict[str, tuple[str, str]], cc: list[str], folder: Path,
         version: str) -> Calls | ctypes.CDLL:
    """`lib`'s entry points of `signatures` through the extension (a Calls), built by `cc` (which
    says it is `version`) into `folder` (the library's own); or `lib` itself where the extension
    cannot be built or loaded, or LOCKSTEP_NATIVE_CALLS=ctypes asks for it. The extension holds
    one library's addresses per process: build.library() binds it once."""
    asked = os.environ.get("LOCKSTEP_NATIVE_CALLS") or "extension"
    if asked not in ("extension", "ctypes"):
        raise ValueError(f"LOCKSTEP_NATIVE_CALLS: expected 'extension' or 'ctypes', got {asked!r}")
    if asked == "ctypes":
        return lib
    try:
        code = source(signatures)
        try:
            module = _load(_build(cc, code, folder, version))
        except ImportError:  # a cached file that does not load (cut short, say): built again, once
            module = _load(_build(cc, code, folder, version, rebuild=True))
        module.bind({name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in signatures},
                    ctypes.c_void_p)
    except (OSError, ImportError) as e:
        logging.getLogger("lockstep").warning("lockstep: the native kernels are called through ctypes, which costs "
                                              "a few microseconds more per call (their extension could not be "
                                              "built: %s)", e)
        return lib
    return Calls(module, lib, list(signatures))
