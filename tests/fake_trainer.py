"""TorchTitan's Trainer as far as its checkpoint is concerned, with titan_nvfp4's train_state installed on it
(integration/train_state.py: the SR call counts and step state saved beside the trainer's own)."""

from __future__ import annotations

from titan_nvfp4.integration import train_state


class FakeTrainer:
    """TorchTitan's Trainer, as far as its checkpoint is concerned (torchtitan/train.py)."""

    def __init__(self, model):
        self.model_parts, self.step, self.ntokens_seen = [model], 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict):
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


train_state.install(FakeTrainer)
