"""NVFP4Trainer: TorchTitan 0.3's Trainer whose Config gains a `quantize` section (0.2's [quantize.linear.nvfp4]
and [quantize.grouped_mm.nvfp4]), applied to the model config before the Trainer builds the model."""

from dataclasses import dataclass, field

from torchtitan.trainer import Trainer

from .converter import NVFP4GroupedMMConfigConverter, NVFP4LinearConfigConverter


@dataclass(kw_only=True, slots=True)
class QuantizeConfig:
    """titan_nvfp4's NVFP4 sections."""

    linear: NVFP4LinearConfigConverter.Config = field(
        default_factory=lambda: NVFP4LinearConfigConverter.Config(enable=False))
    """NVFP4 for the dense Linears (`--quantize.linear.enable` turns it on, `--quantize.linear.no-enable` off)."""
    grouped_mm: NVFP4GroupedMMConfigConverter.Config = field(
        default_factory=lambda: NVFP4GroupedMMConfigConverter.Config(enable=False))
    """NVFP4 for the routed MoE experts (`--quantize.grouped_mm.enable` / `--quantize.grouped_mm.no-enable`)."""


def prepare_offline_data(config: Trainer.Config) -> None:
    """Build (when missing) and register the offline pystdlib corpus at hf_assets_path if the job reads it."""
    from ..data.registry import TRAIN_NAME, VALIDATION_NAME

    names = {getattr(config.dataloader, "dataset", None),
             getattr(getattr(config.validator, "dataloader", None), "dataset", None)}
    if names & {TRAIN_NAME, VALIDATION_NAME}:
        from ..data.prepare import prepare

        prepare(config.hf_assets_path)


def apply_quantize(config: Trainer.Config) -> None:
    """Convert ``config.model_spec.model`` per ``config.quantize`` (in place; converting twice is a no-op)."""
    spec = config.model_spec
    if spec is None:
        return
    for section in (config.quantize.linear, config.quantize.grouped_mm):
        if section.enable:
            spec.model = section.build().convert(spec.model)


class NVFP4Trainer(Trainer):
    """Trainer with the `quantize` section; everything else is TorchTitan's."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
        """titan_nvfp4's NVFP4 sections."""

    def __init__(self, config: Config):
        prepare_offline_data(config)
        apply_quantize(config)
        super().__init__(config)
