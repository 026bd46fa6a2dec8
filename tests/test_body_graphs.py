"""Eager CUDA graphs of the NVFP4 Linear's bodies (titan_nvfp4/autograd/body_graphs.py): which calls replay, which run
eagerly, and that either way the bits are the eager path's. On the CPU a stand-in capture gives CUDA-graph
semantics (capturing runs nothing; a replay rewrites the tensors the capture returned); tests/test_gpu.py
repeats the comparison with real graphs and a whole model."""

import pytest
import torch

from titan_nvfp4 import NVFP4Linear, NVFP4Recipe
from titan_nvfp4.autograd.body_graphs import SMALL_ELEMENTS, BodyGraphs, graphable
from titan_nvfp4.autograd.linear_function import nvfp4_linear, sr_counter
from titan_nvfp4.numerics.rht import rht_signs
from titan_nvfp4.ops.backends import interpreting
from graph_helpers import StandInCapture

DEV = "cuda" if torch.cuda.is_available() else "cpu"




def _run(calls, graphs, weight, bias, counter, signs, recipe):
    """Run a call sequence; each item: ("train", x, dy) forward+backward, ("twice", (x1, dy1), (x2, dy2)) two
    forwards before their backwards, ("nograd", x) a forward under no_grad, ("move",) the weight re-allocated."""
    out = []
    for call in calls:
        if call[0] == "move":
            weight.data = weight.data.clone()
            continue
        if call[0] == "nograd":
            with torch.no_grad():
                out.append(nvfp4_linear(call[1], weight, bias, recipe, counter, signs, graphs=graphs))
            continue
        pairs = [call[1:]] if call[0] == "train" else list(call[1:])
        xs = [p[0].clone().requires_grad_(True) for p in pairs]
        ys = [nvfp4_linear(x, weight, bias, recipe, counter, signs, graphs=graphs) for x in xs]
        for x, y, (_, dy) in zip(xs, ys, pairs):
            weight.grad = bias.grad = None
            y.backward(dy)
            out += [y.detach(), x.grad, weight.grad.clone(), bias.grad.clone()]
    return out


@pytest.mark.parametrize("capture", ["stand-in", "cuda"])
def test_replayed_bodies_give_the_eager_bits_and_step_aside_when_unsafe(capture):
    """Steps replay once warmed up (forward from the 2nd call, backward from the 3rd); a forward whose last
    outputs still wait for their backward, a moved weight and no_grad calls run eagerly or leave the graphs
    free; every output, gradient and the SR counter equal the eager path's bit for bit."""
    if capture == "cuda" and DEV == "cpu":
        pytest.skip("real CUDA graphs need a GPU")
    if DEV == "cpu" and not interpreting():
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    recipe = NVFP4Recipe(gemm_backend="emulated")
    g = torch.Generator().manual_seed(0)
    m, k, n = 16, 16, 32
    xs = [torch.randn(m, k, generator=g).to(DEV) for _ in range(7)]
    dys = [torch.randn(m, n, generator=g).to(DEV) for _ in range(7)]
    calls = [("train", xs[0], dys[0]), ("train", xs[1], dys[1]), ("train", xs[2], dys[2]),
             ("twice", (xs[3], dys[3]), (xs[4], dys[4])), ("nograd", xs[5]), ("move",), ("train", xs[6], dys[6])]
    results = []
    for graphed in (False, True):
        torch.manual_seed(1)
        weight = torch.nn.Parameter(torch.randn(n, k, generator=torch.Generator().manual_seed(2)).to(DEV))
        bias = torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(3)).to(DEV))
        counter, signs = sr_counter(recipe, 3, DEV), rht_signs(recipe.rht_seed, DEV)
        graphs = None
        if graphed:
            graphs = BodyGraphs() if capture == "cuda" else BodyGraphs(StandInCapture([counter]), check_device=False)
        results.append((_run(calls, graphs, weight, bias, counter, signs, recipe), counter.clone(), graphs))
    (eager, c_eager, _), (replayed, c_graphs, graphs) = results
    assert len(eager) == len(replayed)
    for i, (a, b) in enumerate(zip(eager, replayed)):
        assert torch.equal(a, b), f"output {i} differs"
    assert torch.equal(c_eager, c_graphs) and int(c_eager[1]) == 6  # six backwards drew SR numbers
    # forward: warm, capture + replay, replay, replay, eager (the last outputs wait for their backward),
    # no_grad (a key of its own: warm), eager (moved weight); backward: warm, warm again (its saved operands
    # are now the graph's), capture + replay, replay, eager (saved operands not the graph's), eager
    assert (graphs.captures, graphs.replays, graphs.eager) == (2, 5, 8)


def test_graphs_only_for_small_eager_gpu_calls():
    """The size rule, the knob's values (both sections: test_grouped_graphs.py for the experts), and no graphs on the
    CPU or with the knob off."""
    from titan_nvfp4.recipe.knobs import LinearKnobs

    assert LinearKnobs(eager_graphs="small").build_recipe().eager_graphs == "small"
    assert graphable(8192, 256, 704, "small") and not graphable(8192, 256, 704, "off")
    assert not graphable(32768, 2048, 5632, "small") and graphable(SMALL_ELEMENTS // 32, 16, 16, "small")
    assert graphable(8192, 512, 4096, "small")  # the deepseek_v3 debug model's wkv_b: host-bound
    assert not graphable(8192, 4096, 4096, "small")  # a Llama3-8B attention Linear: 2^26 elements but 2^38 MACs
    assert not graphable(2048, 2048, 2 * 1408, "small", 64 * 2 * 1408 * 2048)  # DeepSeek-V3-16B experts' weights
    assert graphable(8192, 256, 512, "small", 8 * 512 * 256)  # the debug model's experts
    with pytest.raises(ValueError, match="eager_graphs must be one of"):
        NVFP4Recipe(eager_graphs="always")
    layer = NVFP4Linear(32, 32, recipe=NVFP4Recipe(eager_graphs="small"))
    assert layer._body_graphs(torch.zeros(4, 32), layer.weight, None) is None  # CPU: never
    if torch.cuda.is_available():
        layer = layer.cuda()
        x = torch.zeros(4, 32, device="cuda")
        assert isinstance(layer._body_graphs(x, layer.weight, None), BodyGraphs)
        assert layer._body_graphs(x, layer.weight, None) is layer._body_graphs(x, layer.weight, None)
        assert layer._body_graphs(x, layer.weight, 1) is not layer._body_graphs(x, layer.weight, None)
        off = NVFP4Linear(32, 32, recipe=NVFP4Recipe()).cuda()
        assert off._body_graphs(x, off.weight, None) is None


@pytest.mark.parametrize("round_to_input", [False, True])
def test_a_graphed_forward_reads_in_place_only_the_tensors_whose_addresses_are_checked(monkeypatch, round_to_input):
    """A CUDA graph replays its reads at their captured addresses, so every tensor the forward body reads other
    than its copied inputs must be one of the ``bound`` tensors BodyGraphs checks (weight, bias, the layer's
    signs). The signs' cast to a bf16 X's dtype (``rht_round_to_input_dtype``) once happened outside the body:
    a tensor freed after the capture, whose memory later replays would have read as signs."""
    if DEV == "cpu" and not interpreting():
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    seen = []
    run = BodyGraphs.run

    def checking_run(self, key, body, copied, bound, owner=None):
        seen.append([name for name, v in body.keywords.items()
                     if isinstance(v, torch.Tensor) and not any(v is b for b in bound)])
        return run(self, key, body, copied, bound, owner)

    monkeypatch.setattr(BodyGraphs, "run", checking_run)
    recipe = NVFP4Recipe(gemm_backend="emulated", rht_round_to_input_dtype=round_to_input)
    weight = torch.nn.Parameter(torch.randn(32, 16, generator=torch.Generator().manual_seed(0)).to(DEV))
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1)).to(DEV, torch.bfloat16).requires_grad_(True)
    graphs = BodyGraphs(StandInCapture([]), check_device=False)
    for _ in range(2):
        nvfp4_linear(x, weight, None, recipe, sr_counter(recipe, 0, DEV), rht_signs(recipe.rht_seed, DEV),
                     graphs=graphs).float().sum().backward()
    assert len(seen) == 4 and seen == [[]] * 4, seen
