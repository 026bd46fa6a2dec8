"""The training layer, framework-free: what converted models need between optimizer steps (step counts, the late
high-precision switch, low-rank refreshes, amax windows, telemetry) and what a checkpoint must carry for them."""
