"""The NVFP4 telemetry in TorchTitan's metrics: MetricsProcessor.log (the same class in TorchTitan 0.2 and 0.3) adds
what the layers measured (telemetry.py, which imports no TorchTitan) to its extra metrics. Both integrations install
it when a telemetry_every knob is set."""

from ..modules.telemetry import drain_all


def install_metrics_hook() -> None:
    """Make TorchTitan's MetricsProcessor.log add the pending telemetry to its extra metrics (idempotent)."""
    from torchtitan.components.metrics import MetricsProcessor

    if getattr(MetricsProcessor.log, "_nvfp4_telemetry", False):
        return
    original = MetricsProcessor.log

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        extra = dict(extra_metrics or {})
        extra.update(drain_all())
        return original(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)

    log._nvfp4_telemetry = True
    MetricsProcessor.log = log


__all__ = ["install_metrics_hook"]
