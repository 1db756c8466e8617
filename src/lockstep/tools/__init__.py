"""The tools behind the command line: `verify` (the train-inference gate), `report` (HTML from a
run's JSON), `bench` (ops against eager PyTorch), `batch_experiment` (the batch-size experiment on a
transformers model), `gpu_audit` (Triton kernels compiled to NVIDIA machine code without a GPU, the
launches `gpu_launches` records) and `backend_bits` (the native backend's recorded bits)."""
