"""Eager CUDA graphs of the NVFP4 grouped experts (``eager_graphs = "small"`` in [quantize.grouped_mm.nvfp4]): the
grouped kernels' forward and backward bodies replayed (a stand-in capture on the CPU, graph_helpers.py) give the
eager path's bits step after step, the offsets changing and stochastic rounding on; the knob in the grouped
section; which calls get graphs. tests/test_gpu.py repeats it with real graphs on the deepseek_v3
debug model's experts."""

from __future__ import annotations

import pytest
import torch

import titan_nvfp4
from titan_nvfp4 import NVFP4Recipe
from titan_nvfp4.autograd.body_graphs import BodyGraphs
from titan_nvfp4.autograd.grouped_function import nvfp4_grouped_mm_shared, nvfp4_grouped_swiglu
from titan_nvfp4.autograd.linear_function import sr_counter
from titan_nvfp4.modules.expert_groups import experts_body_graphs
from titan_nvfp4.numerics.rht import rht_signs
from titan_nvfp4.recipe.knobs import GroupedKnobs

from graph_helpers import StandInCapture
from moe_helpers import build_moe, cpu_triton

E, D, F, T = 2, 16, 16, 48  # experts, model dim, hidden dim, routed rows (fixed, as TorchTitan pads them)
#: the token groups of each step (multiples of 16, either expert empty, tail rows past the last): they change every
#: step while the row count stays, so a replay reading the capture's offsets would give another step's numbers;
#: three steps: the backward's first replay is the third
OFFSETS = ([16, 32], [0, 48], [32, 32])


def _steps(graphed: bool):
    """len(OFFSETS) training steps of a SwiGLU expert block as NVFP4GroupedExperts runs it (W1 and W3 on one
    quantization of x, the SwiGLU fused with h's amaxes, W2 on them; W2 with per-expert biases as gpt-oss's mlp2),
    the same x, weights and dY every step: only the offsets and the SR draws differ. Returns (per step: y, dx and
    the parameters' grads; the SR counters; the two calls' BodyGraphs). 1×16 weight blocks: the interpreter's
    16×16 weight kernel would take most of a minute here (test_gpu.py runs the fused W1|W3 GEMM of 16×16 blocks)."""
    recipe = NVFP4Recipe(gemm_backend="emulated", weight_2d=False)  # SR and RHT on
    g = torch.Generator().manual_seed(0)
    x0, dy = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    w1, w3 = (torch.nn.Parameter(torch.randn(E, F, D, generator=g) * 0.1) for _ in range(2))
    w2 = torch.nn.Parameter(torch.randn(E, D, F, generator=g) * 0.1)
    b2 = torch.nn.Parameter(torch.randn(E, D, generator=g))
    c = torch.stack([sr_counter(recipe, 10 + j) for j in range(3)])
    signs = rht_signs(recipe.rht_seed)
    g1 = g2 = None
    if graphed:
        g1, g2 = (BodyGraphs(StandInCapture([c]), check_device=False) for _ in range(2))
    out = []
    for offs in OFFSETS:
        x = x0.clone().requires_grad_(True)
        offsets = torch.tensor(offs, dtype=torch.int32)
        h, h_amax = nvfp4_grouped_swiglu(x, w1, w3, offsets, recipe, (c[0], c[2]), signs, True, graphs=g1)
        y = nvfp4_grouped_mm_shared(h, (w2,), offsets, (b2,), recipe, (c[1],), signs, True, x_amax=h_amax,
                                    graphs=g2)[0]
        for p in (w1, w2, w3, b2):
            p.grad = None
        y.backward(dy)
        out.append([y.detach(), x.grad, w1.grad, w2.grad, w3.grad, b2.grad])
    return out, c, (g1, g2)


@cpu_triton
def test_replayed_grouped_bodies_give_the_eager_bits_with_changing_offsets_and_sr():
    """Every output, gradient and SR counter equal the eager path's, bit for bit, at every step; forward replays
    from the 2nd step, backward from the 3rd (warmed again once its saved operands became the forward graph's);
    the offsets are honoured: the same x gives another y at each step, as eager does."""
    (eager, c_eager, _), (graphed, c_graphed, graphs) = _steps(False), _steps(True)
    for step, (a, b) in enumerate(zip(eager, graphed)):
        for i, (u, v) in enumerate(zip(a, b)):
            assert torch.equal(u, v), f"step {step}, tensor {i}"
    assert all(not torch.equal(a[0], b[0]) for a, b in zip(graphed, graphed[1:])), "same y for other offsets"
    n = len(OFFSETS)
    assert torch.equal(c_eager, c_graphed) and c_eager[:, 1].tolist() == [n] * 3  # one SR draw per backward
    # forward: warm, then capture + replay, replays; backward: warm, warm again, capture + replay, replays
    for gr in graphs:
        assert (gr.captures, gr.replays, gr.eager) == (2, (n - 1) + (n - 2), 1 + 2)


def test_eager_graphs_is_a_knob_of_the_grouped_section(tmp_path):
    """One knob, one name: accepted in [quantize.grouped_mm.nvfp4] (TOML and titan_nvfp4.convert, whose
    experts=True copies it from the dense keywords), bad values refused naming the section, key and value."""
    from torchtitan.config import ConfigManager

    assert GroupedKnobs(eager_graphs="small").build_recipe().eager_graphs == "small"
    assert GroupedKnobs().build_recipe().eager_graphs == "off"
    with pytest.raises(ValueError, match=r"\[quantize.grouped_mm.nvfp4\] eager_graphs must be one of \['off', "
                                         r"'small'\], got 'always'"):
        GroupedKnobs(eager_graphs="always")
    job = tmp_path / "job.toml"
    head = '[job]\ncustom_config_module = "titan_nvfp4.integration.job_config"\n[quantize.grouped_mm.nvfp4]\n'
    job.write_text(head + 'eager_graphs = "small"\n')
    cfg = ConfigManager().parse_args(["--job.config_file", str(job)])
    assert cfg.quantize.grouped_mm.nvfp4.build_recipe().eager_graphs == "small"
    job.write_text(head + 'eager_graphs = "large"\n')
    with pytest.raises(Exception, match=r"\[quantize.grouped_mm.nvfp4\] eager_graphs must be one of .*'large'"):
        ConfigManager().parse_args(["--job.config_file", str(job)])
    for experts in (True, {"eager_graphs": "small"}):
        model, _ = titan_nvfp4.convert(build_moe("deepseek_v3")[0], eager_graphs="small", experts=experts)
        recipes = [m.recipe for m in model.modules() if type(m).__name__ == "NVFP4GroupedExperts"]
        assert recipes and all(r.eager_graphs == "small" for r in recipes), experts
    with pytest.raises(ValueError, match=r"\[quantize.grouped_mm.nvfp4\] eager_graphs must be one of .*'on'"):
        titan_nvfp4.convert(build_moe("deepseek_v3")[0], experts={"eager_graphs": "on"})


class _Experts(torch.nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.recipe = NVFP4Recipe(eager_graphs=mode)


def test_which_expert_calls_get_graphs():
    """Graphs only with the knob on, on a GPU, eager, unsharded and small enough; one BodyGraphs per call."""
    w = torch.zeros(8, 256, 256)
    on, off = _Experts("small"), _Experts("off")
    assert experts_body_graphs(on, "w1", torch.zeros(64, 256), (w, w), False) is None  # CPU: never
    if not torch.cuda.is_available():
        return
    x, w = torch.zeros(49280, 256, device="cuda"), w.cuda()  # the deepseek_v3 debug job's routed rows
    first = experts_body_graphs(on, "w1", x, (w, w), False)
    assert isinstance(first, BodyGraphs) and experts_body_graphs(on, "w1", x, (w, w), False) is first
    assert experts_body_graphs(on, "w2", x, (w,), False) not in (None, first)
    assert experts_body_graphs(off, "w1", x, (w, w), False) is None
    assert experts_body_graphs(on, "w1", x, (w, w), True) is None  # expert or tensor parallelism
    big = torch.zeros(8, 4096, 256, device="cuda")
    assert experts_body_graphs(on, "w1", x, (big, big), False) is None  # M·(K+N) over 2^26
