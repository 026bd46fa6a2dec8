"""What both TorchTitan integrations share and nothing else needs: which generation is installed, and the metrics
hook that adds NVFP4 telemetry to TorchTitan's logs. Importing this package imports no TorchTitan."""
