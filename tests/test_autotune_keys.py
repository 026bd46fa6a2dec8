"""Autotuning keys of the kernels that see routed tokens: under expert parallelism the token count of
the grouped operands changes every step, and a key holding it exactly re-tunes every kernel each step
(every config benchmarked, hundreds of ms). The keys hold it rounded up to a power of two
(launch.tune_bucket). On the CPU the launches are recorded and the autotuners' keys evaluated on them;
on a GPU the autotuners' caches are counted over a sweep of token counts."""

import pytest
import torch

triton = pytest.importorskip("triton")

from titan_nvfp4.kernels import gemm as g  # noqa: E402
from titan_nvfp4.kernels import launch as L  # noqa: E402
from titan_nvfp4.kernels import quantize as q  # noqa: E402
from titan_nvfp4.kernels import swiglu as sw  # noqa: E402
from titan_nvfp4.numerics.nvfp4 import quantize_nvfp4  # noqa: E402
from titan_nvfp4.numerics.rht import rht_signs  # noqa: E402

GPU = torch.cuda.is_available()
TUNED = {q._quantize_kernel: q._quantize_autotuned, q._amax_kernel: q._amax_autotuned,
         q._quantize_2d_kernel: q._quantize_2d_autotuned, sw._swiglu_fwd_kernel: sw._fwd_autotuned,
         sw._swiglu_bwd_kernel: sw._bwd_autotuned, g._dequant_kernel: g._dequant_autotuned}


def test_tune_bucket_rounds_up_to_a_power_of_two():
    assert [L.tune_bucket(n) for n in (0, 1, 2, 3, 16, 17, 1008, 1024, 1025, 2**31 - 1)] == \
        [1, 1, 2, 4, 16, 32, 1024, 1024, 2048, 2**31]


def _offsets(tokens: int, experts: int = 4) -> torch.Tensor:
    """Uneven token-group ends, multiples of 16, the last at ``tokens`` (one group empty)."""
    ends = [(tokens // 16 * k // (experts + 1)) * 16 for k in range(1, experts)] + [tokens]
    ends[0] = ends[1]  # an empty expert
    return torch.tensor(ends, dtype=torch.int32)


def _recorded_keys(monkeypatch, run) -> list[tuple]:
    """(kernel name, the values its autotuner keys on) for every launch run() makes; nothing runs."""
    calls = []
    record = lambda fn, grid, *a, **k: calls.append((fn, a, k))  # noqa: E731
    monkeypatch.setattr(q, "launch", record)
    monkeypatch.setattr(g, "launch", record)
    run()
    keys = []
    for fn, a, k in calls:
        tuned = TUNED.get(fn, fn)
        bound = {**dict(zip(tuned.arg_names, a)), **k}
        keys.append((fn.__name__, tuple(bound[n] for n in tuned.keys)))
    assert keys, "run() launched nothing"
    return keys


def _grouped_step(tokens: int, dim: int = 32, hidden: int = 48):
    """The token-sized launches of one grouped expert block: X's two operands (with their amaxes), the
    SwiGLU and its backward, dY's stochastic operands, and the staging of a saved column operand."""
    offsets = _offsets(tokens)
    x, dy = torch.randn(tokens, dim), torch.randn(tokens, hidden)
    signs, seed = rht_signs(0, "cpu"), torch.zeros(1, dtype=torch.int64)

    def run():
        q.quantize_operand_tensors(x, colwise=True, signs=signs, groups=offsets, row_staged=True)
        sw.swiglu_amax_tensors(dy, dy, offsets, True, signs)
        sw.swiglu_backward_amax_tensors(dy, dy, dy, offsets, True, signs)
        q.quantize_operand_tensors(dy, colwise=True, signs=signs, stochastic_row=True, stochastic_col=True,
                                   seed=seed, groups=offsets)
        g.dequantize_fp16(quantize_nvfp4(x.t().contiguous(), block_shape=(1, 16)))
    return run


def test_token_counts_of_one_power_of_two_share_every_tuning(monkeypatch):
    """1040, 1504 and 2048 tokens key every autotuner alike; 2064 (past 2048) keys them anew."""
    want = _recorded_keys(monkeypatch, _grouped_step(2048))
    assert {name for name, _ in want} >= {"_quantize_kernel", "_amax_kernel", "_swiglu_fwd_kernel",
                                          "_swiglu_bwd_kernel", "_dequant_kernel"}
    for tokens in (1040, 1504):
        assert _recorded_keys(monkeypatch, _grouped_step(tokens)) == want, tokens
    other = _recorded_keys(monkeypatch, _grouped_step(2064))
    assert [a[0] for a in other] == [a[0] for a in want]
    assert all(a[1] != b[1] for a, b in zip(other, want)), "a kernel's key did not see the token count at all"


def test_weight_kernels_key_on_the_rows_bucket(monkeypatch):
    w = torch.randn(96, 64)
    keys = _recorded_keys(monkeypatch, lambda: q.quantize_weight_2d_tensors(w))
    assert keys == [("_amax_kernel", (128, 64, True, False, False)),
                    ("_quantize_2d_kernel", (128, 64, True, False, False))]


@pytest.mark.skipif(not GPU, reason="autotuning runs on CUDA tensors only")
@pytest.mark.parametrize("cached_launches", [True, False])
def test_changing_token_counts_tune_once_on_gpu(cached_launches, monkeypatch):
    """A sweep of routed-token counts in one power of two (as expert parallelism gives from step to
    step) adds at most one entry to each autotuner's cache, through the launch cache and through
    Triton's own launches, and every count gives the bits of the fixed-tile kernels."""
    monkeypatch.setattr(L, "ENABLED", cached_launches)
    dim, experts = 2048, 8
    signs = rht_signs(0, "cuda")
    seed = torch.full((1,), 5, dtype=torch.int64, device="cuda")
    tuned = [q._quantize_autotuned, q._amax_autotuned, sw._fwd_autotuned, sw._bwd_autotuned]
    before = [len(t.cache) for t in tuned]

    def step(x, offsets):
        xr, xrs, xc, xcs, gs = q.quantize_operand_tensors(x, colwise=True, signs=signs, groups=offsets,
                                                          stochastic_row=True, stochastic_col=True, seed=seed)
        h, ha = sw.swiglu_amax_tensors(x, x, offsets, True, signs)
        d1, d3, a1, a3 = sw.swiglu_backward_amax_tensors(x, x, x, offsets, True, signs)
        return [xr, xrs.view(torch.uint8), xc, xcs.view(torch.uint8), gs, h, ha, d1, d3, a1, a3]

    for tokens in (4096, 3984, 3200, 2064):
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        offsets = _offsets(tokens, experts).cuda()
        got = step(x, offsets)
        with monkeypatch.context() as m:
            m.setattr(q, "_tuned", lambda _x: False)  # fixed tiles, no autotuner
            want = step(x, offsets)
        for a, b in zip(got, want):
            assert torch.equal(a, b), tokens
    grown = [len(t.cache) - b for t, b in zip(tuned, before)]
    assert all(n <= 1 for n in grown), grown


def _autotuners():
    from triton.runtime.autotuner import Autotuner

    from titan_nvfp4.kernels import grouped_gemm, mxfp8
    return {f"{m.__name__}.{k}": v for m in (g, grouped_gemm, mxfp8, q, sw) for k, v in vars(m).items()
            if isinstance(v, Autotuner)}


@pytest.mark.skipif(not L.TUNE_ON_DISK, reason="this Triton cannot keep autotuning choices on disk")
def test_every_autotuner_keeps_its_choices_on_disk():
    """The choices persist in Triton's cache folder (launch.autotune), so a second process skips the benchmarks."""
    tuners = _autotuners()
    assert len(tuners) == 13, sorted(tuners)
    interpret = triton.knobs.runtime.interpret  # Triton turns the disk cache off in its CPU interpreter
    assert all(t.cache_results != interpret for t in tuners.values()), {k: t.cache_results for k, t in tuners.items()}


_TUNE_ONCE = """
import torch
from titan_nvfp4.kernels.grouped_gemm import grouped_gemm_tokens
from titan_nvfp4.kernels.quantize import quantize_operand
quantize_operand(torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16))
a, b = (torch.randn(1024, 8192, device="cuda", dtype=torch.float16) for _ in range(2))
offsets = torch.arange(1, 9, device="cuda", dtype=torch.int32) * 1024
gs = torch.ones(9, device="cuda")
grouped_gemm_tokens(a, b, offsets, gs, gs, torch.float32)  # configs with a pre-hook (TMA block shapes)
torch.cuda.synchronize()
"""


@pytest.mark.skipif(not GPU, reason="autotuning runs on CUDA tensors only")
def test_a_second_process_reads_the_choices_instead_of_benchmarking(tmp_path):
    """With an empty cache folder the first process benchmarks the amax and quantize configs and the wgrad GEMM's
    (whose configs carry a pre-hook: ShippedAutotuner keeps that choice); a second one benchmarks nothing; with
    TITAN_NVFP4_AUTOTUNE_CACHE=0 a third benchmarks again (the control)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "TRITON_PRINT_AUTOTUNING": "1"}

    def benchmarked(extra=None) -> int:
        out = subprocess.run([sys.executable, "-c", _TUNE_ONCE], env={**env, **(extra or {})}, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.count("Autotuning kernel")

    first = benchmarked()
    assert first > 2, first
    assert benchmarked() == 0
    assert benchmarked({"TITAN_NVFP4_AUTOTUNE_CACHE": "0"}) == first


def test_configs_whose_tma_tiles_overflow_shared_memory_are_never_benchmarked(monkeypatch):
    """The GEMMs' first config, 128×256×128 in 3 stages, needs 3·(128+256)·128·2 B = 288 KiB of fp16 TMA tiles: over an
    H100's 227 KiB it fails after a compile (Triton's OutOfResources, 294,936 B on the DeepSeek-V3-16B wgrad GEMM),
    so the prune drops it there. Tiles of an operand the kernel does not load through TMA are not counted, and where
    nothing fits every config is kept (Triton then names the failure)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from titan_nvfp4.kernels import grouped_gemm as gg

    monkeypatch.setattr(g, "shared_memory", lambda device: 232448)  # sm_90's opt-in limit
    a16, b16 = torch.zeros(256, 256, dtype=torch.float16), torch.zeros(512, 256, dtype=torch.float16)
    desc = {"a_desc": TensorDescriptor.from_tensor(a16, [128, 64]), "b_desc": TensorDescriptor.from_tensor(b16, [256, 64])}
    configs = gg._configs()
    shapes = lambda cs: [(c.kwargs["BM"], c.kwargs["BN"], c.kwargs["BK"], c.num_stages) for c in cs]  # noqa: E731
    kept = shapes(g.tma_tiles_fit(configs, desc, TMA=True))
    assert (128, 256, 128, 3) not in kept and kept == [s for s in shapes(configs) if s != (128, 256, 128, 3)]
    assert shapes(g.tma_tiles_fit(configs, {"a_desc": a16, "b_desc": b16}, TMA=False)) == shapes(configs)
    dense = g._configs()
    assert (128, 256, 128, 3) not in shapes(g.tma_tiles_fit(dense, desc, B_TMA=True, A_STAGED=True))
    # A from codes (not through a_desc): B's tiles alone, 3·256·128·2 B = 192 KiB, fit
    assert shapes(g.tma_tiles_fit(dense, desc, B_TMA=True, A_STAGED=False)) == shapes(dense)
    monkeypatch.setattr(g, "shared_memory", lambda device: 1024)
    assert g.tma_tiles_fit(configs, desc, TMA=True) == configs
    for tuner in (g._nvfp4_gemm_autotuned, gg._rows_autotuned, gg._tokens_autotuned):
        assert tuner.early_config_prune is g.tma_tiles_fit
