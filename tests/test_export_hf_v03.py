"""export_hf's TorchTitan 0.3 form (skipped unless torchtitan 0.3 and the export03 extra are installed): a run named by
its config registry entry (--module titan_nvfp4.integration_v03.configs --config llama3_debug_nvfp4), its model-only
DCP checkpoint exported through TorchTitan 0.3's Llama3StateDictAdapter and loaded with transformers. The fused QKV
Linear (one NVFP4 weight, one tensor scale) becomes q/k/v_proj, each with its rows of the codes and scales."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from titan_nvfp4.integration_common.torchtitan_version import installed_generation

if installed_generation() != "0.3":
    pytest.skip("needs torchtitan 0.3 (.ci/torchtitan03)", allow_module_level=True)
if not all(importlib.util.find_spec(m) for m in ("transformers", "compressed_tensors", "safetensors")):
    pytest.skip("the export03 extra (transformers, compressed-tensors, safetensors; in test03) is not installed",
                allow_module_level=True)

import torch  # noqa: E402

from titan_nvfp4.modules.nvfp4_linear import NVFP4Linear  # noqa: E402
from titan_nvfp4.tools.export_hf import main as export_main  # noqa: E402
from titan_nvfp4.tools.job_model_v03 import parse_config  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from export_helpers import fails as _fails, tokenizer as _tokenizer  # noqa: E402

SEQ = 32
REGISTRY = ["--module", "titan_nvfp4.integration_v03.configs", "--config", "llama3_debug_nvfp4"]


@pytest.fixture(scope="module")
def v03(tmp_path_factory):
    """The llama3 debug model of the 0.3 config with NVFP4 Linears, initialized and saved model-only (DCP)."""
    import torch.distributed.checkpoint as dcp
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    tmp = tmp_path_factory.mktemp("export_hf_v03")
    assets = _tokenizer(tmp / "assets")
    flags = [*REGISTRY, "--hf_assets_path", str(assets), "--training.seq_len", str(SEQ)]
    config = parse_config(flags)
    mc = config.model_spec.model
    mc.update_from_config(config=config)
    with torch.device("meta"):
        model = mc.build()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dcp.save(state, checkpoint_id=str(tmp / "checkpoint" / "step-1"))
    return tmp, flags, model, state, config.model_spec.state_dict_adapter(mc, None)


@pytest.mark.long
def test_v03_bf16_and_nvfp4_exports_load_in_transformers(v03, capsys):
    """BF16: transformers' LlamaForCausalLM (config.json from the 0.3 model config tree) holds the checkpoint's weights
    in BF16 (wv split from the fused wqkv by the state dict) and computes finite logits. NVFP4: q/k/v_proj of a block
    share the fused wqkv's tensor scale, and compressed-tensors decompresses each to its rows (split by the state
    dict, permuted by the adapter) of the NVFP4 weight our forward quantizes from the checkpoint, bit for bit in
    BF16; the folder loads in transformers."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from titan_nvfp4.tools.compressed_nvfp4 import forward_nvfp4_weight

    tmp, flags, model, state, adapter = v03
    ckpt = tmp / "checkpoint"
    out = tmp / "hf_bf16"
    export_main([str(ckpt), *flags, "--format", "bf16", "--out", str(out)])
    assert "step 1 of" in capsys.readouterr().out
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert torch.equal(hf.get_parameter("model.layers.0.self_attn.v_proj.weight"),
                       state["layers.0.attention.qkv_linear.wv.weight"].to(torch.bfloat16).float())
    assert torch.equal(hf.get_parameter("model.layers.0.mlp.down_proj.weight"),
                       state["layers.0.feed_forward.w2.weight"].to(torch.bfloat16).float())
    tokens = torch.randint(0, 2048, (2, SEQ), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.isfinite(hf(tokens).logits).all()

    out = tmp / "hf_nvfp4"
    export_main([str(ckpt), *flags, "--format", "nvfp4", "--out", str(out)])
    config = json.loads((out / "config.json").read_text())
    scheme = QuantizationConfig.model_validate(config["quantization_config"]).config_groups["group_0"]
    saved = {}
    for f in out.glob("*.safetensors"):
        saved.update(load_file(str(f)))
    wqkv = model.get_submodule("layers.0.attention.qkv_linear.wqkv")
    assert isinstance(wqkv, NVFP4Linear)
    wq = forward_nvfp4_weight(wqkv.weight.detach(), wqkv.recipe)
    # the fused weight's dequantized rows, split and permuted as the model's state dict and the adapter do
    fused = wq.dequantize(torch.float32)
    with torch.no_grad():
        saved_weight = wqkv.weight.detach().clone()
        wqkv.weight.copy_(fused)
        split = {k: v.clone() for k, v in model.state_dict().items() if ".attention.qkv_linear.w" in k
                 and k.startswith("layers.0.")}
        wqkv.weight.copy_(saved_weight)
    want = adapter.to_hf(split)
    scales = set()
    for hf_key, w in want.items():
        prefix = hf_key.removesuffix(".weight")
        parts = {p: saved[f"{prefix}.{p}"] for p in ("weight_packed", "weight_scale", "weight_global_scale")}
        scales.add(float(parts["weight_global_scale"]))
        got = NVFP4PackedCompressor.decompress(parts, scheme)["weight"]
        assert torch.equal(got, w.to(torch.bfloat16)), hf_key
    assert len(want) == 3 and len(scales) == 1, "q, k, v: one tensor scale, the fused weight's"
    hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        assert torch.isfinite(hf(tokens).logits).all()


def test_v03_needs_the_registry_entry(v03, capsys):
    tmp, flags, *_ = v03
    out = tmp / "bad"
    err = _fails(capsys, [str(tmp / "checkpoint"), "--format", "bf16", "--out", str(out)], out)
    assert "--module MODULE --config NAME are required (TorchTitan 0.3)" in err
    err = _fails(capsys, [str(tmp / "checkpoint"), "--module", "titan_nvfp4.integration_v03.configs", "--config",
                          "no_such_config", "--format", "bf16", "--out", str(out)], out)
    assert "--config no_such_config: titan_nvfp4.integration_v03.configs has no such config" in err


def test_v03_missing_transformers_names_the_export03_extra(v03, capsys, monkeypatch):
    """Without transformers (hidden from the import system), export_hf names the extra that installs beside
    TorchTitan 0.3 (export03: export's transformers needs a huggingface-hub torchtitan 0.3 refuses)."""
    tmp, flags, *_ = v03
    monkeypatch.setitem(sys.modules, "transformers", None)
    out = tmp / "no_transformers"
    err = _fails(capsys, [str(tmp / "checkpoint"), *flags, "--format", "bf16", "--out", str(out)], out)
    assert err.endswith("needs transformers: pip install 'titan-nvfp4[export03]'"), err
