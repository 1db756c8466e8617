"""lockstep's backends: one package per backend, one module per op in each.

    portable/   PyTorch ops in fixed tile shapes and fixed reduction orders (CPU, any device)
    triton/     Triton kernels (GPU; on CPU under Triton's interpreter)
    eager/      plain PyTorch as model code writes it: not invariant, for comparison
    reference/  float64 textbook formulas, sharing no code with the kernels

`lockstep.registry` imports a backend's package the first time it is used, then the module of each
op of registry.OPS that the package holds (registry.op_module names it); importing a module
registers its op. An op a backend has no module for is one it does not implement. Which backend claims which op is data: contract.toml's [backends.*] tables.
"""

import re


def triton_interpreter_refusal(triton_version: str, numpy_version: str) -> str | None:
    """Why Triton's interpreter cannot run the Triton backend's kernels with these releases, or None.
    Triton 3.6's interpreter turns a loop bound into a one-element numpy array, which numpy 2.4 no
    longer converts to an int, so every kernel with a runtime loop bound fails (measured: triton 3.6.0
    fails with numpy 2.4.6 and runs with 2.3.5; triton 3.7.0 runs with 2.4.6). Kept outside
    backends/triton so that it imports where that package refuses to."""
    def release(version: str) -> tuple[int, ...]:
        return tuple(int(part) for part in re.findall(r"\d+", version)[:2])

    if release(triton_version) < (3, 7) and release(numpy_version) >= (2, 4):
        return (f"Triton {triton_version}'s interpreter (TRITON_INTERPRET=1, the Triton backend without a GPU) "
                f"cannot run with numpy {numpy_version}: its loops fail with 'only 0-dimensional arrays can be "
                "converted to Python scalars'; install triton>=3.7 or numpy<2.4")
    return None
