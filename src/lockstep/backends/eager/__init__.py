"""The "eager" backend: plain PyTorch, written the way model code usually is. Not invariant.

It exists for comparison: `lockstep check --backend eager` shows where stock PyTorch breaks the
contract, and the relative-accuracy criterion measures lockstep against it. The registry imports its
op modules on first use.
"""
