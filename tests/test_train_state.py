"""SR call counts in TorchTitan's train_state (integration/train_state.py): a resumed run draws the same
stochastic-rounding numbers as the uninterrupted one, and the model's state-dict keys stay nn.Linear's."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import titan_nvfp4.integration  # noqa: F401
from titan_nvfp4 import NVFP4Linear, NVFP4Recipe
from titan_nvfp4.integration import train_state

from fake_trainer import FakeTrainer

SR = NVFP4Recipe(gemm_backend="reference", stochastic_rounding=True)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(NVFP4Linear(64, 32, recipe=SR, layer_id=0), nn.ReLU(), NVFP4Linear(32, 16, recipe=SR, layer_id=1))


def _step(model, x):
    model.zero_grad()
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_resumed_run_draws_the_same_sr_numbers(tmp_path):
    x = torch.randn(32, 64)
    a = _model()
    for _ in range(3):
        _step(a, x)
    trainer = FakeTrainer(a)
    trainer.step = 3
    sd = trainer.state_dict()
    assert set(sd[train_state.KEY]) == {"0", "2"} and int(sd[train_state.KEY]["0"][0]) == 3
    dcp.save({"train_state": trainer, "model": a.state_dict()}, checkpoint_id=str(tmp_path / "step-3"))
    assert set(a.state_dict()) == {"0.weight", "0.bias", "2.weight", "2.bias"}, "model keys stay nn.Linear's"

    b = _model()
    resumed = FakeTrainer(b)
    state = {"train_state": resumed, "model": b.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "step-3"))
    b.load_state_dict(state["model"])
    assert resumed.step == 3 and b[0].sr_calls == 3
    want = _step(a, x)  # the uninterrupted run's 4th backward
    got = _step(b, x)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    fresh = _model()
    assert not all(torch.equal(g, w) for g, w in zip(_step(fresh, x), want)), "without the counts: other numbers"


def test_installed_on_the_trainer_of_python_m_torchtitan_train(monkeypatch):
    main = types.ModuleType("__main__")
    main.__spec__ = importlib.machinery.ModuleSpec("torchtitan.train", None)

    class Trainer:  # not yet installed
        def state_dict(self):
            return {"step": self.step}

        def load_state_dict(self, state_dict):
            self.step = state_dict["step"]

    main.Trainer = Trainer
    monkeypatch.setitem(sys.modules, "__main__", main)
    train_state.install_on_running_trainers()
    assert Trainer._nvfp4_train_state
    t = Trainer.__new__(Trainer)
    t.model_parts, t.step = [_model()], 5
    assert train_state.KEY in t.state_dict()
