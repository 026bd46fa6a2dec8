"""The TorchTitan 0.3 integration on CPU (skipped unless torchtitan 0.3 is installed; .ci/torchtitan03 runs it):
config parsing, the config-tree converter, and Llama3 debugmodel through llama3's own parallelize on one
gloo rank, forward and backward with NVFP4 layers."""

import math

import pytest

from titan_nvfp4.torchtitan_version import installed_generation

if installed_generation() != "0.3":
    pytest.skip("needs torchtitan 0.3 (.ci/torchtitan03)", allow_module_level=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common.linear import Linear  # noqa: E402

from titan_nvfp4.integration_v03.modules import TitanNVFP4Linear  # noqa: E402
from titan_nvfp4.integration_v03.trainer import NVFP4Trainer, apply_quantize  # noqa: E402

MODULE = "titan_nvfp4.integration_v03.configs"
SEQ, BATCH = 64, 2


def parse(config: str = "llama3_debug_nvfp4", *overrides: str):
    return ConfigManager().parse_args(["--module", MODULE, "--config", config, *overrides])


def block_linears(model_config) -> dict[str, type]:
    return {fqn: type(cfg) for fqn, cfg, _, _ in model_config.traverse(Linear.Config) if fqn.startswith("layers.")}


def test_config_parses_with_overrides():
    c = parse("llama3_debug_nvfp4", "--quantize.linear.recipe", "naive_rtn", "--quantize.linear.gemm_backend",
              "reference", "--quantize.linear.filter_fqns", "lm_head,wo", "--training.seq_len", str(SEQ))
    assert isinstance(c, NVFP4Trainer.Config) and c.quantize.linear.enable
    assert c.quantize.linear.filter_fqns == ["lm_head", "wo"] and c.training.seq_len == SEQ
    recipe = c.quantize.linear.build_recipe()
    assert recipe.gemm_backend == "reference" and not recipe.stochastic_rounding  # naive_rtn
    assert (c.dataloader.dataset, c.training.disable_cuda_graphs) == ("pystdlib", True)
    assert c.hf_assets_path.endswith("assets/pystdlib")
    bf16 = parse("llama3_debug_bf16")
    assert not bf16.quantize.linear.enable and bf16.quantize.linear.filter_fqns[0] == "lm_head"


@pytest.mark.parametrize("args, words", [
    (["--quantize.linear.gemm_backend", "bogus"], ["quantize.linear", "gemm_backend", "bogus"]),
    (["--quantize.linear.recipe", "no_such_preset"], ["unknown recipe", "no_such_preset"]),
    (["--quantize.linear.lora_rank", "16"], ["lora_rank", "not supported by the TorchTitan 0.3 integration"]),
    (["--quantize.linear.no_such_knob", "1"], ["Unrecognized options", "--quantize.linear.no_such_knob"]),
])
def test_bad_knob_stops_the_parse_naming_it(capsys, args, words):
    with pytest.raises(SystemExit) as e:
        parse("llama3_debug_nvfp4", *args)
    assert e.value.code != 0
    err = " ".join(capsys.readouterr().err.replace("│", " ").split())
    for w in words:
        assert w in err, (w, err[-1500:])


def test_converter_swaps_every_block_linear_on_meta():
    c = parse("llama3_debug_nvfp4")
    apply_quantize(c)
    types = block_linears(c.model_spec.model)
    assert len(types) == 6 * 5 and set(types.values()) == {TitanNVFP4Linear.Config}  # wqkv, wo, w1, w2, w3
    ids = [cfg.layer_id for _, cfg, _, _ in c.model_spec.model.traverse(TitanNVFP4Linear.Config)]
    assert ids == list(range(30)) and type(c.model_spec.model.lm_head) is Linear.Config
    apply_quantize(c)  # converting twice is a no-op
    assert [cfg.layer_id for _, cfg, _, _ in c.model_spec.model.traverse(TitanNVFP4Linear.Config)] == ids
    bf16 = parse("llama3_debug_bf16")
    apply_quantize(bf16)
    assert set(block_linears(bf16.model_spec.model).values()) == {Linear.Config}


def build_parallelized(c, monkeypatch):
    """The model of ``c`` on meta, through llama3's parallelize_fn on the 1-rank gloo mesh, then materialized."""
    import torchtitan.distributed.parallel_dims as pd_module
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    monkeypatch.setattr(pd_module, "device_type", "cpu")
    spec, mc = c.model_spec, c.model_spec.model
    for _, _, parent, attr in list(mc.traverse(FlexAttention.Config)):  # CPU: FlexAttention has no backward
        setattr(parent, attr, ScaledDotProductAttention.Config())
    mc.update_from_config(config=c)
    dist_utils.set_spmd_backend(c.parallelism.spmd_backend)
    pd = ParallelDims.from_config(c.parallelism, 1)
    with torch.device("meta"):
        model = mc.build()
    model.verify_module_protocol()
    model = spec.parallelize_fn(model, parallel_dims=pd, training=c.training, parallelism=c.parallelism,
                                compile_config=c.compile, ac_config=c.activation_checkpoint, dump_folder=c.dump_folder)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


@pytest.fixture
def gloo_rank():
    """A 1-rank gloo group, on one intra-op thread (the tiny GEMMs run 5x slower on oversubscribed cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    torch.set_num_threads(threads)


@pytest.mark.parametrize("model_name, blocks", [("llama3", 6), ("qwen3", 8)])
def test_debugmodel_forward_backward_in_nvfp4(gloo_rank, monkeypatch, tmp_path, model_name, blocks):
    """The registry's <model>_debug_nvfp4 through the model's own parallelize_fn: every block Linear (fused wqkv,
    wo, w1, w2, w3) in NVFP4, a finite loss near uniform at init, gradients and one SR call per layer, and the
    checkpoint keys of the BF16 twin."""
    torch.manual_seed(0)
    c = parse(f"{model_name}_debug_nvfp4", "--quantize.linear.gemm_backend", "reference", "--training.seq_len",
              str(SEQ), "--training.local_batch_size", str(BATCH), "--dump_folder", str(tmp_path))
    apply_quantize(c)
    model = build_parallelized(c, monkeypatch)
    nvfp4 = {n: m for n, m in model.named_modules() if isinstance(m, TitanNVFP4Linear)}
    assert len(nvfp4) == blocks * 5
    lin = model.layers["0"].feed_forward.w1
    assert lin.recipe.gemm_backend == "reference" and int(lin.sr_counter[1]) == 0
    vocab = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding)).num_embeddings
    tokens = torch.randint(0, vocab, (BATCH, SEQ))
    out = model(tokens, positions=torch.arange(SEQ).repeat(BATCH, 1), attention_masks=None)
    loss = torch.nn.functional.cross_entropy(out.float().flatten(0, 1), tokens.flatten())
    loss.backward()
    value = float(loss.detach())
    assert math.isfinite(value) and abs(value - math.log(vocab)) < 1.5  # near uniform at init
    assert all(m.weight.grad is not None and torch.isfinite(m.weight.grad.full_tensor()
               if hasattr(m.weight.grad, "full_tensor") else m.weight.grad).all() for m in nvfp4.values())
    assert all(m.sr_calls == 1 for m in nvfp4.values())  # one backward drew one SR call per layer
    keys = set(model.state_dict())
    bf16 = parse(f"{model_name}_debug_bf16")
    with torch.device("meta"):
        assert keys == set(bf16.model_spec.model.build().state_dict())  # the same checkpoint keys as BF16
