"""lockstep's backends: one package per backend, one module per op in each.

    portable/   PyTorch ops in fixed tile shapes and fixed reduction orders (CPU, any device)
    triton/     Triton kernels (GPU; on CPU under Triton's interpreter)
    eager/      plain PyTorch as model code writes it: not invariant, for comparison
    reference/  float64 textbook formulas, sharing no code with the kernels

`lockstep.registry` imports a backend's package the first time it is used; importing a module
registers its op. Which backend claims which op is data: contract.toml's [backends.*] tables.
"""
