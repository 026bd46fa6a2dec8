"""The module layer: NVFP4Linear, DecomposedLinear, the low-rank expert factors and the per-layer state the modules
keep (stochastic-rounding streams, activation amax windows, telemetry)."""
