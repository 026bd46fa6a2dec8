"""NVFP4 under TorchTitan's parallelisms: tensor amaxes reduced across the ranks that shard an operand
(amax.py), and tensor-parallel NVFP4 Linears on DTensor weights (tensor_parallel.py)."""
