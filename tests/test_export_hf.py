"""export_hf: a tiny Llama3 trained a few steps on the CPU (reference backend), saved by TorchTitan's
CheckpointManager, exported, and loaded with transformers' AutoModelForCausalLM as a user would.

BF16: the logits equal TorchTitan's model with the same (BF16) weights. NVFP4: compressed-tensors' own
decompressor gives back exactly the codes and scales our forward computed with, and transformers' logits equal
TorchTitan's with those weights. Bad input ends in one line and leaves no folder behind."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import re
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if not all(importlib.util.find_spec(m) for m in ("transformers", "compressed_tensors", "safetensors")):
    pytest.skip("the export extra (transformers, compressed-tensors, safetensors) is not installed",
                allow_module_level=True)  # found, not imported: the FSDP2 ranks import this module

import titan_nvfp4.integration  # noqa: F401  (registers the converters)
import titan_nvfp4.autograd.linear_function as linear_function
from titan_nvfp4.modules.nvfp4_linear import NVFP4Linear
from titan_nvfp4.numerics.formats import pack_nibbles, unpack_nibbles
from titan_nvfp4.tools.export_hf import main as export_main
from titan_nvfp4.training.train_state import load_amax_histories
from torchtitan.models.llama3 import Transformer, llama3_args
from torchtitan.protocols.model_converter import build_model_converters
from torchtitan.protocols.train_spec import get_train_spec
from export_helpers import fails as _fails, tokenizer as _tokenizer
from export_run_helpers import (FLAVOR, SEQ, STEPS, checkpointer, corpus_in, job_toml, plain_llama, random_tokens,
                                register_flavor, train, validation_flags, validator_loss)

pytestmark = pytest.mark.usefixtures("transformers_logs_through_logging")


def _forward_weights(model) -> dict:
    """{NVFP4 layer name: the NVFP4Tensor its forward GEMM multiplies}, caught from a forward of ``model``: each
    weight the forward quantized is matched to the layer whose (full) weight, in the quantized dtype, it equals."""
    seen = []
    quantize = linear_function.quantize_weight

    def spy(w, *args, **kwargs):
        out = quantize(w, *args, **kwargs)
        seen.append((w.detach().clone(), out[0]))
        return out

    linear_function.quantize_weight = spy
    try:
        with torch.no_grad():
            model(random_tokens(99))
    finally:
        linear_function.quantize_weight = quantize
    found = {}
    for name, m in model.named_modules():
        if isinstance(m, NVFP4Linear):
            full = m.weight.full_tensor() if hasattr(m.weight, "full_tensor") else m.weight
            (wq,) = [q for w, q in seen if w.shape == full.shape and torch.equal(w, full.detach().to(w.dtype))]
            found[name] = wq
    return found


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    register_flavor()
    tmp = tmp_path_factory.mktemp("export_hf")
    assets = _tokenizer(tmp / "assets")
    job = job_toml(tmp, assets, extra="activation_amax_history = 2\n")  # the w4a4 export's input scales
    model = train(tmp, job)
    dense = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return SimpleNamespace(tmp=tmp, job=job, assets=assets, model=model, dense=dense,
                           forward=_forward_weights(model), ckpt=tmp / "checkpoint")


def _export(run, out: Path, *flags: str, job: Path | None = None) -> None:
    export_main([str(run.ckpt), "--job.config_file", str(job or run.job), "--out", str(out), *flags])


def _hf(out: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(out), **{"dtype": torch.float32, **kwargs}).eval()


def _adapter():
    return get_train_spec("llama3").state_dict_adapter(llama3_args[FLAVOR], None)


# ------------------------------------------------------------------------------------------------- BF16

def test_bf16_export_loads_in_transformers_with_torchtitans_logits(run, capsys):
    """The latest step (step-3) of the checkpoint folder; transformers' logits in fp32 equal TorchTitan's llama3
    with the same BF16 weights within 2e-6 (logits up to ~3.5, so 8 fp32 ulps; 1 seen: RoPE as complex products vs
    cos/sin, torch's RMSNorm vs transformers')."""
    out = run.tmp / "hf_bf16"
    _export(run, out, "--format", "bf16", "--max-shard-size", "100KB")
    assert "step 3 of" in capsys.readouterr().out
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.safetensors.index.json"} <= files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "100KB shards: several"
    assert not [p for p in run.tmp.iterdir() if p.name.startswith(".hf_bf16")], "no temporary folder left"
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "llama3" and config["num_key_value_heads"] == 2
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
    hf = _hf(out)
    ours = plain_llama({k: v.to(torch.bfloat16).float() for k, v in run.dense.items()})
    tokens = random_tokens(7)
    with torch.no_grad():
        want, got = ours(tokens), hf(tokens).logits
    assert torch.allclose(got, want, rtol=0, atol=2e-6), (got - want).abs().max()
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(out))("w5 w9")["input_ids"][-2:] == [5, 9]


# ------------------------------------------------------------------------------------------------ NVFP4

HF_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj")
PARTS = ("weight_packed", "weight_scale", "weight_global_scale")


def _safetensors(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = {}
    for f in sorted(out.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def _hf_value(adapter, key: str, value: torch.Tensor) -> tuple[str, torch.Tensor]:
    """(Hugging Face name, value) of one entry, through TorchTitan's adapter (q/k rows permuted)."""
    ((name, out),) = adapter.to_hf({key: value}).items()
    return name, out


@pytest.fixture(scope="module")
def nvfp4_out(run):
    out = run.tmp / "hf_nvfp4"
    _export(run, out, "--format", "nvfp4")
    return out


def test_nvfp4_export_holds_the_forwards_codes_scales_and_tensor_scale(run, nvfp4_out):
    """compressed-tensors' parser takes the quantization_config (BF16 block 2 and the LM head ignored), and its
    NVFP4PackedCompressor decompresses each layer to exactly the weight our forward multiplied: with the global
    scale set to 1, q·e_b bit for bit (codes and 1×16 scales, our 16×16 tile scales repeated per row); with it, the
    BF16 weight our fp32 q·e_b·(1/S) rounds to. The global scale is S, whose fp32 reciprocal is our decode scale."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = json.loads((nvfp4_out / "config.json").read_text())
    qc = QuantizationConfig.model_validate(config["quantization_config"])
    assert qc.format == "nvfp4-pack-quantized" and qc.quantization_status == "compressed"
    assert set(qc.ignore) == {"lm_head", *(f"model.layers.2.{m}" for m in HF_LINEARS)}
    scheme = qc.config_groups["group_0"]
    state = _safetensors(nvfp4_out)
    adapter = _adapter()
    assert len(run.forward) == 14, "blocks 0 and 1 in NVFP4"
    for name, wq in run.forward.items():
        key = f"{name}.weight"
        hf_key, want_codes = _hf_value(adapter, key, wq.scaled_codes(torch.float32))
        _, want = _hf_value(adapter, key, wq.dequantize(torch.float32))
        prefix = hf_key.removesuffix(".weight")
        parts = {p: state[f"{prefix}.{p}"] for p in PARTS}
        assert hf_key not in state
        n, k = wq.shape
        assert (parts["weight_packed"].dtype, tuple(parts["weight_packed"].shape)) == (torch.uint8, (n, k // 2))
        assert (parts["weight_scale"].dtype, tuple(parts["weight_scale"].shape)) == (torch.float8_e4m3fn, (n, k // 16))
        assert (parts["weight_global_scale"].dtype, tuple(parts["weight_global_scale"].shape)) == (torch.float32, (1,))
        assert torch.equal(torch.reciprocal(parts["weight_global_scale"]), wq.global_scale.reshape(1)), name
        exact = NVFP4PackedCompressor.decompress({**parts, "weight_global_scale": torch.ones(1)}, scheme)["weight"]
        assert torch.equal(exact.float(), want_codes), f"{name}: codes or block scales"
        got = NVFP4PackedCompressor.decompress(parts, scheme)["weight"]
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16)), name
    for m in HF_LINEARS:  # the BF16 block: dense BF16 weights
        key = f"model.layers.2.{m}.weight"
        assert state[key].dtype == torch.bfloat16 and f"model.layers.2.{m}.weight_packed" not in state


def test_nvfp4_export_loads_in_transformers_with_the_forwards_weights(run, nvfp4_out):
    """AutoModelForCausalLM with compressed-tensors installed, as a user loads it (config.json's BF16, the Linears
    compressed, decompressed by compressed-tensors at the first forward): each NVFP4 Linear then holds our forward's
    NVFP4 weight in BF16, bit for bit. For an fp32 comparison the folder is loaded with dtype float32 and
    CompressedTensorsConfig(dequantize=True) (compressed, in float32, compressed-tensors decompresses into BF16 and
    F.linear refuses the mix): the logits equal TorchTitan's llama3 with those weights (the rest in BF16) within
    2e-6, as for the BF16 export."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    adapter = _adapter()
    weights = {k: v.to(torch.bfloat16).float() for k, v in run.dense.items()}
    for name, wq in run.forward.items():
        weights[f"{name}.weight"] = wq.dequantize(torch.float32).to(torch.bfloat16).float()
    hf_weights = dict(_hf_value(adapter, f"{name}.weight", weights[f"{name}.weight"]) for name in run.forward)
    tokens = random_tokens(7)

    user = AutoModelForCausalLM.from_pretrained(str(nvfp4_out)).eval()
    assert user.dtype == torch.bfloat16
    assert {n for n, _ in user.get_submodule("model.layers.0.self_attn.q_proj").named_parameters()} == set(PARTS)
    with torch.no_grad():
        assert torch.isfinite(user(tokens).logits).all()
    for hf_key, w in hf_weights.items():
        assert torch.equal(user.get_parameter(hf_key).float(), w), hf_key

    hf = _hf(nvfp4_out, quantization_config=CompressedTensorsConfig(dequantize=True))
    for hf_key, w in hf_weights.items():
        assert torch.equal(hf.get_parameter(hf_key), w), hf_key
    ours = plain_llama(weights)
    with torch.no_grad():
        want, got = ours(tokens), hf(tokens).logits
    assert torch.allclose(got, want, rtol=0, atol=2e-6), (got - want).abs().max()


# ------------------------------------------------------------------------------------------------ low rank

def _side_run(run, name: str, knobs: str) -> SimpleNamespace:
    """A job of the same model with ``knobs`` added to its NVFP4 section, trained two steps in run.tmp/name."""
    tmp = run.tmp / name
    tmp.mkdir()
    job = job_toml(tmp, run.assets, extra=knobs)
    model = train(tmp, job, steps=2)
    return SimpleNamespace(tmp=tmp, job=job, model=model, ckpt=tmp / "checkpoint")


@pytest.fixture(scope="module")
def lora_run(run):
    """A lora_rank 16 job (the same model), two steps."""
    return _side_run(run, "lora", "lora_rank = 16\n")


def test_lowrank_layers_export_the_weight_the_forward_computes_with(lora_run):
    """BF16: a DecomposedLinear's weight is W = R + U·diag(σ)·V (its dense_weight, summed in fp32), in BF16; NVFP4 is
    refused by name (compressed-tensors' NVFP4 cannot hold the branch)."""
    from titan_nvfp4.modules.decomposed_linear import DecomposedLinear

    out = lora_run.tmp / "hf"
    export_main([str(lora_run.ckpt / "step-2"), "--job.config_file", str(lora_run.job), "--out", str(out),
                 "--format", "bf16"])
    state = _safetensors(out)
    adapter = _adapter()
    lowrank = {n: m for n, m in lora_run.model.named_modules() if isinstance(m, DecomposedLinear)}
    assert len(lowrank) == 14
    for name, m in lowrank.items():
        hf_key, w = _hf_value(adapter, f"{name}.weight", m.dense_weight().detach())
        assert torch.equal(state[hf_key], w.to(torch.bfloat16)), name
        assert not (w - m.weight).abs().max() < 1e-3, f"{name}: W, not the residual R"
    assert not any("lora" in k for k in state)


@pytest.fixture(scope="module")
def outcontrol_run(run):
    """An OutControl job (the same model) that selects after step 1, two steps."""
    return _side_run(run, "outcontrol", "outcontrol_fraction = 0.1\noutcontrol_start = 0\noutcontrol_steps = 1\n")


def test_outcontrol_layers_export_in_bf16_and_are_refused_in_nvfp4(outcontrol_run, capsys):
    """After the selection a layer's forward runs some input channels in MXFP8: compressed-tensors' NVFP4 layout
    cannot hold it, so --format nvfp4 names the layer; BF16 holds the weight without the selection's entries."""
    run = outcontrol_run
    assert run.model.layers["0"].attention.wq._outcontrol_on
    out = run.tmp / "hf"
    nvfp4 = [str(run.ckpt), "--job.config_file", str(run.job), "--format", "nvfp4", "--out", str(out)]
    assert ("layer 'layers.0.attention.wq' runs its OutControl-selected input channels in MXFP8 beside NVFP4"
            in _fails(capsys, nvfp4, out))
    export_main([str(run.ckpt), "--job.config_file", str(run.job), "--format", "bf16", "--out", str(out)])
    state = _safetensors(out)
    assert state and not any("outcontrol" in k for k in state)


def test_a_checkpoint_of_another_job_file_is_refused_by_an_entry_the_model_lacks(run, lora_run, outcontrol_run,
                                                                                  capsys):
    """Read through the plain NVFP4 job, a low-rank run's W would be quantized after training and an OutControl
    run's MXFP8 channels dropped; through a shallower flavor, the last block would be cut off. One line each, and
    nothing written."""
    out = run.tmp / "other_job"
    plain = ["--job.config_file", str(run.job), "--format", "nvfp4", "--out", str(out)]
    lacks = r"has '{}', which the job file's model lacks \(\d+ more such keys\): was it written by another job file"
    assert re.search(lacks.format(r"layers\.0\.[a-z_.0-9]+\.lora_\w+"), _fails(capsys, [str(lora_run.ckpt), *plain],
                                                                                   out))
    assert re.search(lacks.format(r"layers\.0\.[a-z_.0-9]+\.outcontrol_(index|done)"),
                     _fails(capsys, [str(outcontrol_run.ckpt), *plain], out))
    llama3_args.setdefault(f"{FLAVOR}_shallow", dataclasses.replace(llama3_args[FLAVOR], n_layers=2))
    assert re.search(lacks.format(r"layers\.2\.[a-z_.0-9]+"),
                     _fails(capsys, [str(run.ckpt), *plain, "--model.flavor", f"{FLAVOR}_shallow"], out))


# ------------------------------------------------------------------------------------------------ bad input

def test_bad_input_is_one_line_and_writes_nothing(run, lora_run, capsys):
    out = run.tmp / "bad"
    base = ["--format", "bf16", "--out", str(out)]
    job = ["--job.config_file", str(run.job)]
    ck = str(run.ckpt)
    assert "no such checkpoint: " in _fails(capsys, [str(run.ckpt / "step-9"), *job, *base], out)
    assert "holds steps 1, 2, 3" in _fails(capsys, [str(run.ckpt / "step-9"), *job, *base], out)
    assert "holds no DCP checkpoint" in _fails(capsys, [str(run.assets), *job, *base], out)
    assert "--job.config_file JOB.toml is required" in _fails(capsys, [ck, *base], out)
    assert "no such file" in _fails(capsys, [ck, "--job.config_file", str(run.tmp / "none.toml"), *base], out)
    assert "'no_such_model'" in _fails(capsys, [ck, *job, "--model.name", "no_such_model", *base], out)
    assert "'qwen3' is not supported by export_hf yet" in _fails(capsys, [ck, *job, "--model.name", "qwen3", *base],
                                                                out)
    assert "is inside the checkpoint folder" in _fails(capsys, [ck, *job, "--format", "bf16", "--out",
                                                                str(run.ckpt / "step-3" / "hf")])
    empty = run.tmp / "no_tokenizer"
    empty.mkdir()
    assert "has no tokenizer" in _fails(capsys, [ck, *job, "--model.hf_assets_path", str(empty), *base], out)
    assert "--max-shard-size '0'" in _fails(capsys, [ck, *job, *base, "--max-shard-size", "0"], out)
    nonempty = run.tmp / "nonempty"
    nonempty.mkdir()
    (nonempty / "keep.txt").write_text("mine")
    assert "exists and is not empty" in _fails(capsys, [ck, *job, "--format", "bf16", "--out", str(nonempty)])
    assert (nonempty / "keep.txt").read_text() == "mine"
    # a --format the model cannot take
    lora = [str(lora_run.ckpt), "--job.config_file", str(lora_run.job), "--format", "nvfp4", "--out", str(out)]
    assert "'layers.0.attention.wq' is low-rank" in _fails(capsys, lora, out)
    late = [ck, *job, "--quantize.linear.nvfp4.bf16_after_fraction", "0.8", "--format", "nvfp4", "--out", str(out)]
    assert "computes in BF16 from step 2 on (bf16_after_fraction = 0.8)" in _fails(capsys, late, out)
    assert "applies to --format nvfp4 only" in _fails(capsys, [ck, *job, *base, "--scheme", "w4a16"], out)


def test_a_failed_write_leaves_no_folder(run, capsys, monkeypatch):
    """The disk fills up at the second shard: one line naming --out, and neither DIR nor its temporary twin."""
    import safetensors.torch

    save_file = safetensors.torch.save_file
    written = []

    def fill_up(tensors, filename, metadata=None):
        if written:
            raise OSError(28, "No space left on device")
        written.append(filename)
        save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", fill_up)
    out = run.tmp / "full"
    err = _fails(capsys, [str(run.ckpt), "--job.config_file", str(run.job), "--format", "bf16", "--out", str(out),
                          "--max-shard-size", "64KB"], out)
    assert written and f"--out {out}: cannot write: No space left on device" in err


def test_weights_stored_narrower_than_the_forward_are_refused_unless_named(run, capsys):
    """A model-only checkpoint in BF16 (checkpoint.export_dtype) of a run whose forward quantized FP32 weights: the
    forward's codes cannot be rebuilt, so --format nvfp4 refuses, naming the key and --weight-dtype; with
    --weight-dtype bfloat16 it exports the stored weights' quantization."""
    import torch.distributed.checkpoint as dcp

    folder = run.tmp / "bf16_ckpt" / "step-3"
    dcp.save({k: v.to(torch.bfloat16) for k, v in run.model.state_dict().items()}, checkpoint_id=str(folder))
    out = run.tmp / "hf_from_bf16"
    argv = [str(folder), "--job.config_file", str(run.job), "--format", "nvfp4", "--out", str(out)]
    err = _fails(capsys, argv, out)
    assert "stores layers.0.attention.wq.weight in torch.bfloat16, but the run's forward quantized torch.float32" in err
    export_main([*argv, "--weight-dtype", "bfloat16"])
    state = _safetensors(out)
    w = run.model.layers["0"].attention.wv.weight.detach().to(torch.bfloat16)
    s = state["model.layers.0.self_attn.v_proj.weight_global_scale"]
    assert torch.equal(torch.reciprocal(s), titan_nvfp4.quantize_nvfp4(w, (16, 16)).global_scale.reshape(1))


def test_fused_groups_whose_global_scales_differ_are_named():
    """vLLM and SGLang read one weight global scale per fused q/k/v (gate/up) GEMM: export_hf names the groups where
    ours differ, and those only partly in NVFP4."""
    from titan_nvfp4.tools.hf_models import HF_MODELS
    from titan_nvfp4.tools.hf_weights import fused_mismatches

    fused = HF_MODELS["llama3"].fused
    attn = "model.layers.{}.self_attn."
    scales = {attn.format(0) + p: 2.0 for p in ("q_proj", "k_proj", "v_proj")}
    scales.update({attn.format(1) + "q_proj": 2.0, attn.format(1) + "k_proj": 3.0, attn.format(1) + "v_proj": 2.0})
    scales[attn.format(2) + "q_proj"] = 2.0
    got = fused_mismatches(scales, [attn.format(2) + "k_proj", attn.format(2) + "v_proj"], fused)
    assert len(got) == 2
    assert got[0].startswith(attn.format(1) + "q_proj") and "global scales 2, 3, 2 differ" in got[0]
    assert "only model.layers.2.self_attn.q_proj in NVFP4" in got[1]


# ------------------------------------------------------------------------------------------------ FSDP2

def _fsdp_worker(rank, world, out, tmp, job, step_dir):
    """FSDP2 over 2 gloo ranks with TorchTitan's mixed precision (BF16 parameters in forward): load the one-process
    checkpoint model-only through the CheckpointManager, catch the NVFP4 weights a forward multiplies, and save as
    a run's last step (last_save_model_only: the model's entries, sharded)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims

    register_flavor()
    cfg = ConfigManager().parse_args(["--job.config_file", str(job)])
    cfg.checkpoint.folder, cfg.checkpoint.initial_load_path = "fsdp_checkpoint", str(step_dir)
    cfg.checkpoint.last_save_model_only = True  # the final save: the model's entries only
    dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=world)
    args = copy.deepcopy(llama3_args[FLAVOR])
    args.update_from_config(cfg)
    with torch.device("meta"):
        model = Transformer(args)
    build_model_converters(cfg, dims).convert(model)
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    _, _, _, ckpt = checkpointer(cfg, model, tmp, dims)
    assert ckpt.load()
    forward = _forward_weights(model)
    ckpt.save(STEPS, last_step=True)
    if rank == 0:
        out["forward"] = {n: (q.data, q.scale, q.global_scale) for n, q in forward.items()}


@pytest.mark.long
def test_a_checkpoint_written_under_fsdp2_exports_as_the_same_weights_from_one_process(run, nvfp4_out, capsys):
    """The step-3 weights, loaded under FSDP2 (2 ranks) and saved sharded there: exported with the same
    --weight-dtype, byte for byte the one-process checkpoint's export; with auto, the sharded norm weights say
    FSDP2, so the weights are quantized in BF16 (mixed_precision_param), the codes and scales the FSDP2 forward
    multiplied."""
    from dist_util import run_ranks

    fsdp = run_ranks(_fsdp_worker, 2, run.tmp, run.job, run.ckpt / "step-3")
    sharded = run.tmp / "fsdp_checkpoint" / "step-3"
    out = run.tmp / "hf_fsdp_fp32"
    export_main([str(sharded), "--job.config_file", str(run.job), "--out", str(out), "--format", "nvfp4",
                 "--weight-dtype", "float32"])
    for f in sorted(p.name for p in nvfp4_out.iterdir()):
        assert (out / f).read_bytes() == (nvfp4_out / f).read_bytes(), f
    out = run.tmp / "hf_fsdp_auto"
    export_main([str(sharded), "--job.config_file", str(run.job), "--out", str(out), "--format", "nvfp4"])
    assert "quantized in bfloat16" in capsys.readouterr().out
    state = _safetensors(out)
    adapter = _adapter()
    assert len(fsdp["forward"]) == 14
    for name, (data, scale, gs) in fsdp["forward"].items():  # to the HF row order through [N, K]-shaped values
        key = f"{name}.weight"
        hf_key, codes = _hf_value(adapter, key, unpack_nibbles(data).float())
        _, scales = _hf_value(adapter, key, scale.float().repeat_interleave(16, dim=0).repeat_interleave(16, dim=1))
        prefix = hf_key.removesuffix(".weight")
        assert torch.equal(state[f"{prefix}.weight_packed"], pack_nibbles(codes.to(torch.uint8))), name
        assert torch.equal(state[f"{prefix}.weight_scale"].float(), scales[:, ::16]), name
        assert torch.equal(torch.reciprocal(state[f"{prefix}.weight_global_scale"]), gs.reshape(1)), name


# ------------------------------------------------------------------------------------------------ w4a4

def _amax_windows(run) -> dict[str, torch.Tensor]:
    """{layer: fp32 [2, 2]} the activation amax windows TorchTitan's CheckpointManager saved in the train_state of
    step-3."""
    import torch.distributed.checkpoint as dcp

    names = [n for n, m in run.model.named_modules() if isinstance(m, NVFP4Linear)]
    state = {f"train_state.nvfp4_amax_history.{n}": torch.zeros(2, 2) for n in names}
    dcp.load(state, checkpoint_id=str(run.ckpt / "step-3"))
    return {n: state[f"train_state.nvfp4_amax_history.{n}"] for n in names}


def _user_w4a4(out: Path, tokens: torch.Tensor):
    """The folder loaded as a user loads it (BF16, compressed Linears), decompressed by a first forward, then cast to
    float32 (by nn.Module's own cast: transformers refuses .float() on a quantized model) so that the activation
    fake-quantization and the matmuls run in fp32."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        assert torch.isfinite(hf(tokens).logits).all()
    return torch.nn.Module.float(hf)


def test_w4a4_export_takes_the_input_scales_from_the_amax_history(run, capsys):
    """compressed-tensors' NVFP4 scheme: input_activations (dynamic "local" 1×16 E4M3 block scales under the static
    input_global_scale). Each input_global_scale is S = 6·448/amax with amax the max of the layer's window (row
    amax), the scale our forward quantizes X with from this checkpoint on. compressed-tensors' activation
    fake-quantization in transformers gives the codes and block scales of our quantize_nvfp4 of the same X with
    that amax, bit for bit. The logits of the exported model (loaded as a user does, decompressed, then cast to
    fp32) equal, within 2e-6 (5e-7 seen), TorchTitan's llama3 holding the exported weights with our quantizer on
    each NVFP4 layer's input; and within 3e-2 (1.2e-2 seen; logits up to 3.5) our NVFP4 forward itself, which
    computes with the fp32 master weights where the folder holds BF16 ones (the NVFP4 weights decoded to BF16 by
    compressed-tensors, the rest stored in BF16): those ≤ 2⁻⁹ relative differences move a few activations across
    E2M1 rounding boundaries, each such element then moving by a whole code step."""
    from compressed_tensors.quantization import QuantizationConfig
    from titan_nvfp4.numerics.nvfp4 import global_encode_scale

    out = run.tmp / "hf_w4a4"
    _export(run, out, "--format", "nvfp4", "--scheme", "w4a4")
    assert "w4a4, input scales from the run's amax history" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    qc = QuantizationConfig.model_validate(config["quantization_config"])
    act = qc.config_groups["group_0"].input_activations
    assert (act.num_bits, act.strategy, act.dynamic, act.group_size) == (4, "tensor_group", "local", 16)
    state = _safetensors(out)
    adapter = _adapter()
    windows = _amax_windows(run)
    amaxes = {}
    for name, m in run.model.named_modules():
        if isinstance(m, NVFP4Linear):
            amaxes[name] = windows[name][:, 0].amax()
            hf_key = _hf_value(adapter, f"{name}.weight", m.weight.detach())[0].removesuffix(".weight")
            s = state[f"{hf_key}.input_global_scale"]
            assert s.dtype == torch.float32 and s.shape == (1,)
            assert torch.equal(s, torch.tensor([2688.0]) / amaxes[name]), name
            assert torch.equal(s, global_encode_scale(amaxes[name]).reshape(1)), name
    assert len(amaxes) == 14 and not any("layers.2" in k and "input_global_scale" in k for k in state)

    load_amax_histories([run.model], windows)  # as a resumed run restores them (they are so already)
    tokens = random_tokens(7)
    hf = _user_w4a4(out, tokens)
    seen = {}

    def catch(module, args):
        seen["x"] = args[0].detach().reshape(-1, args[0].shape[-1]).clone()

    hook = hf.get_submodule("model.layers.1.mlp.down_proj").register_forward_pre_hook(catch)
    with torch.no_grad():
        want = run.model(tokens)  # eval: X quantized with the window's amax
        got = hf(tokens).logits
    hook.remove()
    _same_activation_quantization(hf.get_submodule("model.layers.1.mlp.down_proj"), seen["x"],
                                  amaxes["layers.1.feed_forward.w2"])
    with torch.no_grad():
        exact = _plain_w4a4(run, amaxes)(tokens)
    assert torch.allclose(got, exact, rtol=0, atol=2e-6), (got - exact).abs().max()
    assert torch.allclose(got, want, rtol=0, atol=3e-2), (got - want).abs().max()


def _plain_w4a4(run, amaxes: dict[str, torch.Tensor]):
    """TorchTitan's llama3 without converters (fp32) holding the exported weights (BF16; each NVFP4 layer's weight
    our forward's NVFP4 weight rounded to BF16, as transformers decompresses it), each NVFP4 layer's input
    quantized by our quantize_nvfp4 with the layer's amax (a forward pre-hook)."""
    from titan_nvfp4.numerics.nvfp4 import quantize_nvfp4

    forward = _forward_weights(run.model)
    weights = {k: v.detach().to(torch.bfloat16).float() for k, v in run.model.state_dict().items()}
    for name, wq in forward.items():
        weights[f"{name}.weight"] = wq.dequantize(torch.float32).to(torch.bfloat16).float()
    model = plain_llama(weights)
    for name, amax in amaxes.items():
        def quantize_input(module, args, amax=amax):
            x = args[0]
            x2 = x.reshape(-1, x.shape[-1])
            return (quantize_nvfp4(x2, amax=amax).dequantize(torch.float32).reshape(x.shape),)
        model.get_submodule(name).register_forward_pre_hook(quantize_input)
    return model


def _same_activation_quantization(module, x: torch.Tensor, amax: torch.Tensor) -> None:
    """compressed-tensors' quantization of ``x`` as ``module`` (a loaded Linear of the w4a4 folder) quantizes its
    input: the same E4M3 block scales and E2M1 codes as our quantize_nvfp4(x, amax=amax), bit for bit; decoded, its
    q·(e_b/S) and our q·e_b·(1/S) differ by at most 2 fp32 ulps (a division by S against a product with 1/S)."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize, quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
    from titan_nvfp4.numerics.formats import e2m1_decode, unpack_nibbles
    from titan_nvfp4.numerics.nvfp4 import quantize_nvfp4

    args = module.quantization_scheme.input_activations
    s = module.input_global_scale
    scale, zp = compute_dynamic_scales_and_zp(x, args, module, global_scale=s)
    ours = quantize_nvfp4(x, amax=amax)
    assert torch.equal(scale.float().reshape(ours.scale.shape), ours.scale.float())
    assert torch.equal(quantize(x, scale, zp, args, global_scale=s).float(),
                       e2m1_decode(unpack_nibbles(ours.data)).float())
    want = ours.dequantize(torch.float32)
    assert torch.allclose(fake_quantize(x, scale, zp, args, global_scale=s), want, rtol=2.4e-7, atol=0)


@pytest.fixture(scope="module")
def corpus(run):
    """The tiny corpus, and datasets' cache kept in the test's folder."""
    with corpus_in(run.tmp) as folder:
        yield folder


def test_w4a4_export_calibrates_on_the_jobs_dataset(run, corpus, capsys):
    """--calibration-batches 2 (the checkpoint's amax history is then not read): each input_global_scale is
    6·448/amax with amax the largest |X| the layer's input held in our model's NVFP4 forward (each X quantized with
    its own amax, the windows not loaded) over the first 2 batches of the job's dataloader (TorchTitan's, built from
    the job file)."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.config import ConfigManager
    from torchtitan.hf_datasets.text_datasets import build_text_dataloader

    data = ["--training.dataset", "c4_test", "--training.dataset_path", str(corpus)]
    out = run.tmp / "hf_w4a4_calibrated"
    _export(run, out, "--format", "nvfp4", "--scheme", "w4a4", "--calibration-batches", "2", *data)
    assert "w4a4, input scales calibrated on 2 batches" in capsys.readouterr().out
    cfg = ConfigManager().parse_args(["--job.config_file", str(run.job), *data])
    loader = iter(build_text_dataloader(1, 0, HuggingFaceTokenizer(str(run.assets)), cfg))
    amax = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: amax.__setitem__(n, max(amax.get(n, 0.0),
                                                                                     float(a[0].abs().amax()))))
             for n, m in run.model.named_modules() if isinstance(m, NVFP4Linear)]
    history = run.model.layers["0"].attention.wq.amax_history
    history.ready = False  # the export's model does not load the windows: each X with its own amax
    try:
        with torch.no_grad():
            for _ in range(2):
                run.model(next(loader)[0]["input"])
    finally:
        history.ready = True
        for h in hooks:
            h.remove()
    state = _safetensors(out)
    adapter = _adapter()
    assert len(amax) == 14
    for name, a in amax.items():
        hf_key = _hf_value(adapter, f"{name}.weight", run.dense[f"{name}.weight"])[0].removesuffix(".weight")
        assert torch.equal(state[f"{hf_key}.input_global_scale"], torch.tensor([2688.0]) / torch.tensor(a)), name


def test_w4a4_bad_input_is_one_line_and_writes_nothing(run, corpus, capsys):
    """A model-only checkpoint (no train_state, so no amax windows) without --calibration-batches; a dataset that is
    not there; the options where they do not apply; a recipe compressed-tensors cannot express; an unknown scheme."""
    import torch.distributed.checkpoint as dcp

    out = run.tmp / "bad_w4a4"
    model_only = run.tmp / "model_only" / "step-3"
    dcp.save({k: v for k, v in run.model.state_dict().items()}, checkpoint_id=str(model_only))
    base = [str(run.ckpt), "--job.config_file", str(run.job), "--format", "nvfp4", "--out", str(out)]
    w4a4 = [*base, "--scheme", "w4a4"]
    assert "carries no activation amax history ([quantize.linear.nvfp4] activation_amax_history = 2): pass " \
           "--calibration-batches N" in _fails(capsys, [str(model_only), *w4a4[1:]], out)
    missing = run.tmp / "no_corpus"
    err = _fails(capsys, [*w4a4, "--calibration-batches", "2", "--training.dataset", "c4_test",
                          "--training.dataset_path", str(missing)], out)
    assert f"calibration: cannot read the job's dataset 'c4_test' ({missing})" in err
    assert "--calibration-batches 2 applies to --scheme w4a4 only" in _fails(capsys, [*base, "--calibration-batches",
                                                                                       "2"], out)
    assert "--calibration-batches 0: give a positive" in _fails(capsys, [*w4a4, "--calibration-batches", "0"], out)
    assert "block_scale_rule = four_over_six" in _fails(
        capsys, [*w4a4, "--quantize.linear.nvfp4.block_scale_rule", "four_over_six"], out)
    with pytest.raises(SystemExit) as e:
        export_main([*base, "--scheme", "w8a8"])
    assert e.value.code == 2 and "argument --scheme: invalid choice: 'w8a8'" in capsys.readouterr().err
    assert not out.exists()


# ------------------------------------------------------------------------------------------------ eval_hf

def test_eval_hf_gives_the_validators_loss_of_the_exported_weights(run, corpus, nvfp4_out, capsys):
    """eval_hf reads the job's validation batches with TorchTitan's loader and computes the validator's loss: on the
    BF16 export (and on the NVFP4 one, in fp32) it equals TorchTitan's Validator run on TorchTitan's llama3 holding
    the same weights within 1e-6 relative (the logits agree within 2e-6: see the tests above)."""
    from titan_nvfp4.tools.eval_hf import main as eval_main

    flags = validation_flags(corpus)
    bf16_out = run.tmp / "hf_bf16_eval"
    _export(run, bf16_out, "--format", "bf16")
    bf16 = {k: v.to(torch.bfloat16).float() for k, v in run.dense.items()}
    nvfp4 = dict(bf16)
    for name, wq in run.forward.items():
        nvfp4[f"{name}.weight"] = wq.dequantize(torch.float32).to(torch.bfloat16).float()
    capsys.readouterr()
    for out, weights in ((bf16_out, bf16), (nvfp4_out, nvfp4)):
        report = run.tmp / f"{out.name}_eval.json"
        eval_main([str(out), "--job.config_file", str(run.job), *flags, "--device", "cpu", "--json", str(report)])
        got = json.loads(report.read_text())
        assert (got["batches"], got["tokens"], got["dtype"]) == (3, 3 * 2 * SEQ, "float32")
        assert f"validation loss {got['loss']:.5f} over 3 batches" in capsys.readouterr().out
        want = validator_loss(run.job, run.assets, flags, plain_llama(weights))
        assert abs(got["loss"] - want) <= 1e-6 * want, (out.name, got["loss"], want)


def test_eval_hf_bad_input_is_one_line(run, corpus, nvfp4_out, capsys):
    from titan_nvfp4.tools.eval_hf import main as eval_main

    flags = validation_flags(corpus)  # the cases past the first two read a real export: nvfp4_out
    cases = [
        ([str(run.tmp / "nowhere"), "--job.config_file", str(run.job), *flags], "is not a Hugging Face model folder"),
        ([str(run.assets), "--job.config_file", str(run.job), *flags], "is not a Hugging Face model folder"),
        ([str(nvfp4_out), *flags], "--job.config_file JOB.toml is required"),
        ([str(nvfp4_out), "--job.config_file", str(run.job)], "the job has no validation"),
        ([str(nvfp4_out), "--job.config_file", str(run.job), *flags, "--steps", "0"], "--steps 0"),
        ([str(nvfp4_out), "--job.config_file", str(run.job), *flags[:3], "--validation.dataset_path",
          str(run.tmp / "no_corpus")], "c4_test"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            eval_main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, (argv, err)
