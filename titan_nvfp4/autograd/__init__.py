"""The autograd layer: the NVFP4 Linear and grouped-expert Functions (forward, dgrad, wgrad on quantized operands),
sibling layers' shared input quantization and per-layer CUDA-graph bodies."""
