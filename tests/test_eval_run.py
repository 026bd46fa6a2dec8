"""eval_run: the validation loss of a run's checkpoint on TorchTitan's own model, as the run's validator computes it,
for each export to compare with. The tiny Llama3 of the export tests is trained 2 steps on the CPU (TorchTitan's
CheckpointManager, activation amax windows in its train_state) and evaluated on 3 batches of a tiny corpus.

--forward nvfp4 is the run's validator on the trained model; bf16 and w4a16 equal eval_hf of the bf16 and the
nvfp4 (w4a16) exports, on weights the exports store exactly (see ``exact``). Bad input ends in one line and writes
no JSON."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if not all(importlib.util.find_spec(m) for m in ("transformers", "compressed_tensors", "safetensors")):
    pytest.skip("the export extra (transformers, compressed-tensors, safetensors) is not installed",
                allow_module_level=True)

import titan_nvfp4
from titan_nvfp4.modules.nvfp4_linear import NVFP4Linear
from titan_nvfp4.tools.eval_hf import main as eval_hf
from titan_nvfp4.tools.eval_run import main as eval_run
from titan_nvfp4.tools.export_hf import main as export_hf
from export_helpers import tokenizer
from export_run_helpers import (SEQ, corpus_in, job_toml, plain_llama, register_flavor, train, validation_flags,
                                validator_loss)

pytestmark = pytest.mark.usefixtures("transformers_logs_through_logging")

PROG = "python -m titan_nvfp4.tools.eval_run"
#: relative agreement of the losses of two models computing the same function (their logits agree within 2e-6:
#: test_export_hf.py)
REL = 1e-6


def _exact(model) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(weights, {NVFP4 layer: its weight's NVFP4 values}) of ``model`` made exactly storable by both exports: every
    weight rounded to BF16 (the exports' dtype), each NVFP4 layer's weight first scaled so that its amax is 21·2^m
    (BF16-exact), making its tensor scale S = 6·448/amax a power of two; its NVFP4 values q·e_b/S (a 2-bit code
    times a 4-bit scale) are then BF16-exact too, and compressed-tensors' BF16 decompression returns them as our
    FP32 decode. On the trained weights themselves the exports' BF16 rounding moves their losses by about 7e-5
    relative (seen) from eval_run's, which computes with the FP32 checkpoint."""
    nvfp4 = {n for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    weights, values = {}, {}
    for key, value in model.state_dict().items():
        w = value.detach().float()
        name = key.removesuffix(".weight")
        if name in nvfp4:
            amax = float(w.abs().amax())
            target = 21.0 * 2.0 ** math.ceil(math.log2(amax / 21.0))
            w = w * (target / amax)
        weights[key] = w.to(torch.bfloat16).float()
        if name in nvfp4:
            assert float(weights[key].abs().amax()) == target
            wq = titan_nvfp4.quantize_nvfp4(weights[key], (16, 16))  # nvidia_paper: 16x16 weight tiles
            assert math.log2(float(wq.global_scale)).is_integer(), name
            values[name] = wq.dequantize(torch.float32)
            assert torch.equal(values[name], values[name].to(torch.bfloat16).float()), name
    return weights, values


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run (checkpoint/step-1, step-2), its validation flags, and ``exact``: its step-2 weights made exactly
    storable by the exports (_exact), saved model-only as exact/step-2."""
    import torch.distributed.checkpoint as dcp

    register_flavor()
    tmp = tmp_path_factory.mktemp("eval_run")
    assets = tokenizer(tmp / "assets")
    job = job_toml(tmp, assets, extra="activation_amax_history = 2\n")
    model = train(tmp, job, steps=2)
    weights, values = _exact(model)
    exact = tmp / "exact" / "step-2"
    dcp.save(weights, checkpoint_id=str(exact))
    with corpus_in(tmp) as corpus:
        yield SimpleNamespace(tmp=tmp, job=job, assets=assets, model=model, ckpt=tmp / "checkpoint",
                              flags=validation_flags(corpus), exact=exact, weights=weights, values=values)


def _eval_run(run, checkpoint: Path, forward: str, job: Path | None = None) -> dict:
    out = run.tmp / f"run_{checkpoint.parent.name}_{forward}.json"
    eval_run([str(checkpoint), "--job.config_file", str(job or run.job), *run.flags, "--forward", forward, "--device",
              "cpu", "--json", str(out)])
    got = json.loads(out.read_text())
    assert (got["batches"], got["tokens"], got["dtype"], got["forward"]) == (3, 3 * 2 * SEQ, "float32", forward)
    return got


def _eval_export(run, fmt: list[str], name: str) -> float:
    """eval_hf's loss (float32, CPU) of export_hf's ``fmt`` export of the exact checkpoint."""
    folder = run.tmp / name
    export_hf([str(run.exact), "--job.config_file", str(run.job), "--out", str(folder), *fmt])
    out = run.tmp / f"{name}.json"
    eval_hf([str(folder), "--job.config_file", str(run.job), *run.flags, "--device", "cpu", "--json", str(out)])
    return json.loads(out.read_text())["loss"]


def _close(got: float, want: float) -> None:
    assert abs(got - want) <= REL * want, (got, want, abs(got - want) / want)


def test_nvfp4_forward_is_the_runs_validator(run, capsys):
    """The checkpoint folder (its latest step, 2) with the job's converters and its train_state: the loss of
    TorchTitan's own Validator on the trained model (which holds the same weights and amax windows). The same
    weights saved model-only have no windows: eval_run says so, and each input's own amax gives another loss."""
    import torch.distributed.checkpoint as dcp

    got = _eval_run(run, run.ckpt, "nvfp4")
    assert (got["step"], got["checkpoint"]) == (2, str(run.ckpt / "step-2"))
    assert f"validation loss {got['loss']:.5f} over 3 batches" in capsys.readouterr().out
    _close(got["loss"], validator_loss(run.job, run.assets, run.flags, run.model))
    model_only = run.tmp / "model_only" / "step-2"
    dcp.save(dict(run.model.state_dict()), checkpoint_id=str(model_only))
    without = _eval_run(run, model_only, "nvfp4")["loss"]
    assert "carries no activation amax windows" in capsys.readouterr().err
    assert abs(without - got["loss"]) > 1e-5, "the windows make no difference: the test shows nothing"


def test_bf16_forward_is_the_bf16_exports_loss(run):
    """The same weights without the converters: TorchTitan's Validator on llama3 holding them, and eval_hf of the
    bf16 export (transformers) within 1e-6."""
    got = _eval_run(run, run.exact, "bf16")["loss"]
    _close(got, validator_loss(run.job, run.assets, run.flags, plain_llama(run.weights)))
    _close(got, _eval_export(run, ["--format", "bf16"], "hf_bf16"))


def test_w4a16_forward_is_the_nvfp4_exports_loss(run):
    """Plain Linears holding the NVFP4 values the forward multiplies: TorchTitan's Validator on llama3 holding
    quantize_nvfp4's values of those weights, and eval_hf of the nvfp4 (w4a16) export within 1e-6."""
    got = _eval_run(run, run.exact, "w4a16")["loss"]
    weights = {**run.weights, **{f"{name}.weight": v for name, v in run.values.items()}}
    assert len(run.values) == 14
    _close(got, validator_loss(run.job, run.assets, run.flags, plain_llama(weights)))
    _close(got, _eval_export(run, ["--format", "nvfp4"], "hf_nvfp4"))


def test_lowrank_layers_evaluate_as_their_forward_and_as_w(run, capsys):
    """A lora_rank 16 job trained 2 steps: nvfp4 is TorchTitan's Validator on the trained model (NVFP4(R) plus the
    low-rank branch); bf16 is it on llama3 holding each layer's W = R + U·diag(σ)·V (dense_weight), the checkpoint's
    ``weight`` entry; w4a16, which no export has, is refused naming the layer and the knob."""
    from titan_nvfp4.modules.decomposed_linear import DecomposedLinear

    tmp = run.tmp / "lora"
    tmp.mkdir()
    job = job_toml(tmp, run.assets, extra="lora_rank = 16\n")
    model = train(tmp, job, steps=2)
    capsys.readouterr()  # TorchTitan's messages, when logging goes to stderr
    ckpt = tmp / "checkpoint"
    got = _eval_run(run, ckpt, "nvfp4", job)["loss"]
    _close(got, validator_loss(job, run.assets, run.flags, model))
    state = model.state_dict()
    weights = {k: state[k].detach().clone() for k in run.weights}
    lowrank = {n: m for n, m in model.named_modules() if isinstance(m, DecomposedLinear)}
    assert len(lowrank) == 14
    for name, m in lowrank.items():
        w = m.dense_weight().detach()
        assert not (w - m.weight).abs().max() < 1e-3, f"{name}: W, not the residual R"
        weights[f"{name}.weight"] = w
    got = _eval_run(run, ckpt, "bf16", job)["loss"]
    _close(got, validator_loss(job, run.assets, run.flags, plain_llama(weights)))
    with pytest.raises(SystemExit):
        _eval_run(run, ckpt, "w4a16", job)
    err = capsys.readouterr().err
    assert "--forward w4a16: layer 'layers.0.attention.wq' is low-rank ([quantize.linear.nvfp4] lora_rank, 14 " \
           "layers)" in err and len(err.strip().splitlines()) == 1, err


def test_bad_input_is_one_line_and_writes_no_json(run, capsys):
    out = run.tmp / "bad.json"
    job = ["--job.config_file", str(run.job)]
    base = [*job, *run.flags, "--forward", "bf16", "--device", "cpu", "--json", str(out)]
    ck = str(run.ckpt)
    cases = [
        ([str(run.ckpt / "step-9"), *base], "no such checkpoint: "),
        ([str(run.ckpt / "step-9"), *base], "holds steps 1, 2)"),
        ([str(run.assets), *base], "holds no DCP checkpoint"),
        ([ck, *base, "--forward", "w8a8"], "--forward 'w8a8': choose one of nvfp4, w4a16, bf16"),
        ([ck, *job, "--forward", "bf16", "--json", str(out)], "the job has no validation"),
        ([ck, *base[2:]], "--job.config_file JOB.toml is required"),
        ([ck, *base, "--model.flavor", "debugmodel"], "was it written by another job file"),
        ([ck, *base, "--forward", "nvfp4", "--quantize.linear.nvfp4.lora_rank", "16"],
         "has no 'layers.0.attention.wq.lora_u', which the job file's model has"),
        ([ck, *base, "--steps", "0"], "--steps 0"),
        ([ck, *base, "--json", str(run.tmp / "nowhere" / "x.json")], "no such folder"),
        ([ck, *base, "--forward", "w4a16", "--quantize.linear.nvfp4.bf16_after_fraction", "0.9"],
         "computes in BF16 from step 1 on (bf16_after_fraction)"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            eval_run(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, (argv, err)
        assert err.startswith(f"{PROG}: error: "), err
        assert not out.exists() and not list(run.tmp.glob(".bad.json*")), argv
