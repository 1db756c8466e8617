"""Float64 reference implementations of every op, written for clarity.

They share no code with the kernels: each is the textbook formula in float64 PyTorch, and autograd
through it gives the reference gradients. Inputs of any float dtype are promoted to float64; outputs
are float64. The functions take the public ops' signatures (`reference.linear(x, weight, bias)`),
which is how the harness calls them; each module also registers its op as the "reference" backend,
so that a whole model can run on them (the chain of docs/contract.md, section 4: run the model in
float64 under `use_backend("reference")`).
"""

from ...registry import import_op_modules

# Each op module's function of its own name (reference.linear is linear.linear), for the harness.
_MODULES = import_op_modules(__name__)
globals().update({name: getattr(module, name) for name, module in _MODULES.items()})
__all__ = sorted(_MODULES)
