"""The portable backend: PyTorch ops in fixed tile shapes and fixed reduction orders, any device.
The registry imports its op modules on first use."""
