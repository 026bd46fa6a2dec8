"""Autotuning choices shipped with the package (kernels/shipped_tuning.py, launch.ShippedAutotuner): a key found
in the table launches its config without a benchmark, a key not found autotunes, TITAN_NVFP4_SHIPPED_TUNING=0
switches the table off, a bad table is refused naming the file and the key; the shipped tables name only
configs of their kernels. The autotuner's benchmarks are counted through its do_bench (the CPU has no timer
of its own for Triton), and the chosen config runs in Triton's CPU interpreter."""

import json

import pytest
import torch

triton = pytest.importorskip("triton")
tomllib = pytest.importorskip("tomllib")

from titan_nvfp4.kernels import gemm as g  # noqa: E402
from titan_nvfp4.kernels import launch as L  # noqa: E402
from titan_nvfp4.kernels import shipped_tuning as st  # noqa: E402
from titan_nvfp4.numerics.nvfp4 import quantize_nvfp4  # noqa: E402

REPO = __import__("pathlib").Path(__file__).resolve().parent.parent
GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


@pytest.fixture
def table(tmp_path, monkeypatch):
    """write(kernels) → the path of a table file that TITAN_NVFP4_SHIPPED_TUNING names; the tuner's choices and
    the tables read are forgotten before and after."""
    path = tmp_path / "table.json"

    def write(kernels, doc=None):
        path.write_text(json.dumps(doc if doc is not None else {"format": 1, "kernels": kernels}))
        st.clear()
        return path
    monkeypatch.setenv(st.ENV, str(path))
    monkeypatch.setattr(g._dequant_autotuned, "cache", {})
    if GPU:  # no compiled launch kept from an earlier test (the interpreter has no launch cache)
        monkeypatch.setattr(L.launcher(g._dequant_autotuned), "cache", {})
    st.clear()
    yield write
    st.clear()


@pytest.fixture
def benchmarks(monkeypatch):
    """The dequantization autotuner's benchmark runs, counted (config 3 the fastest); none is launched."""
    runs = []
    tuner = g._dequant_autotuned

    def bench(kernel_call, quantiles=None):
        runs.append(1)
        return [1.0 + (len(runs) - 1 != 3)] * 3
    monkeypatch.setitem(tuner.__dict__, "do_bench", bench)
    monkeypatch.setattr(tuner, "cache_results", False)  # no choice read from Triton's cache folder (GPU)
    return runs


def _dequant_call():
    """(args, kwargs, expected fp16) of a dequantization launch through the autotuner on the CPU."""
    x = torch.randn(48, 64).to(DEV)
    t = quantize_nvfp4(x)
    R, C = t.storage_shape
    out = torch.empty((R, C), dtype=torch.float16, device=DEV)
    words = out.view(torch.int32)
    args = (t.data, t.scale, words, R, C, t.data.stride(0), t.scale.stride(0), t.scale.stride(1), words.stride(0),
            L.tune_bucket(R), L.tune_bucket(C))
    return args, {"SCALE_DIV": 1}, out, g.dequantize_fp16(t)


def _launch(args, kw):
    grid = lambda meta: (L.cdiv(args[3], meta["BR"]), L.cdiv(args[4] // 2, meta["BC"]))  # noqa: E731
    L.launch(g._dequant_autotuned, grid, *args, **kw)


def test_a_key_in_the_table_launches_its_config_without_benchmarks(table, benchmarks):
    args, kw, out, want = _dequant_call()
    tuner = g._dequant_autotuned
    key = L.tuning_key(tuner, args, kw)
    pick = tuner.configs[2]
    table({"_dequant_kernel": {st.key_text(key): st.config_entry(pick)}})
    hits = tuner.shipped_hits
    _launch(args, kw)
    assert benchmarks == [] and tuner.best_config is pick and tuner.shipped_hits == hits + 1
    assert torch.equal(out, want)
    _launch(args, kw)  # the choice stays in the autotuner's cache: not looked up again
    assert tuner.shipped_hits == hits + 1


def test_a_key_not_in_the_table_autotunes_as_triton_keys_it(table, benchmarks):
    args, kw, out, want = _dequant_call()
    tuner = g._dequant_autotuned
    other = list(L.tuning_key(tuner, args, kw))
    other[0] *= 2
    table({"_dequant_kernel": {st.key_text(other): st.config_entry(tuner.configs[0])}})
    _launch(args, kw)
    assert len(benchmarks) == len(tuner.configs) and tuner.best_config is tuner.configs[3]
    assert list(tuner.cache) == [L.tuning_key(tuner, args, kw)]  # our key is the one Triton caches under
    assert torch.equal(out, want)


def test_switched_off_the_table_is_not_read(table, benchmarks, monkeypatch):
    args, kw, _, _ = _dequant_call()
    tuner = g._dequant_autotuned
    table({"_dequant_kernel": {st.key_text(L.tuning_key(tuner, args, kw)): st.config_entry(tuner.configs[1])}},
          doc={"format": 1, "kernels": {"_dequant_kernel": {"not a key": {}}}})  # would be refused if read
    monkeypatch.setenv(st.ENV, "0")
    _launch(args, kw)
    assert len(benchmarks) == len(tuner.configs)


@pytest.mark.parametrize("doc, match", [
    ("{not json", r"table\.json: not readable JSON"),
    ({"kernels": {}}, r"table\.json: expected an object with \"format\": 1"),
    ({"format": 1, "kernels": {"_dequant_kernel": {"[16": {"kwargs": {}}}}},
     r"table\.json: kernel '_dequant_kernel', key \[16: the key is not a JSON list"),
    ({"format": 1, "kernels": {"_dequant_kernel": {"[16]": {"kwargs": {}, "warps": 4}}}},
     r"table\.json: kernel '_dequant_kernel', key \[16\]: expected"),
    ("config", r"table\.json: kernel '_dequant_kernel', key \[64, 64, 1, \"torch.uint8\".*"
               r"is none of the kernel's 5 configs \(regenerate"),
])
def test_a_bad_table_is_refused_naming_the_file_and_key(table, benchmarks, doc, match):
    args, kw, _, _ = _dequant_call()
    if doc == "config":  # a config the kernel does not have (BR 8)
        key = st.key_text(L.tuning_key(g._dequant_autotuned, args, kw))
        doc = {"format": 1, "kernels": {"_dequant_kernel": {key: {"kwargs": {"BR": 8, "BC": 256}, "num_warps": 4}}}}
    path = table({})
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(ValueError, match=match):
        _launch(args, kw)
    assert benchmarks == []


def test_a_missing_table_file_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv(st.ENV, str(tmp_path / "nope.json"))
    st.clear()
    with pytest.raises(ValueError, match=r"TITAN_NVFP4_SHIPPED_TUNING=.*nope\.json: no such table file"):
        st.load(st.table_path(None))
    st.clear()


def test_shipped_tables_name_configs_of_their_kernels():
    """Every shipped table parses, and each entry is a config of a kernel that exists (kernel names unique)."""
    from tests.test_autotune_keys import _autotuners

    tuners = {t.base_fn.__name__: t for t in _autotuners().values()}
    assert len(tuners) == len(_autotuners()) == 13
    assert all(isinstance(t, L.ShippedAutotuner) for t in tuners.values())
    tables = sorted(p for p in st.TABLE_DIR.glob("*.json") if not p.name.endswith(".kernels.json"))  # not manifests
    assert [p.name for p in tables] >= ["sm90.json"]
    for path in tables:
        for kernel in st.load(path):
            assert kernel in tuners, (path.name, kernel)
            st.choices(path, kernel, tuners[kernel].configs)


def test_the_tables_are_package_data():
    """pyproject.toml's package data takes every table file into the wheel (.ci/wheel_smoke.py reads it back)."""
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = data["titan_nvfp4.kernels"]
    found = {p for pattern in globs for p in (REPO / "titan_nvfp4/kernels").glob(pattern)}
    assert set(st.TABLE_DIR.glob("*.json")) <= found and found


def test_the_gpu_class_of_a_hopper_is_sm90(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delenv(st.ENV, raising=False)
    assert st.gpu_class(0) == "sm90" and st.table_path(0) == st.TABLE_DIR / "sm90.json"
    assert st.table_path(None) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (12, 0))
    assert st.table_path(0) is None  # no table for that class: autotune


# ---------------------------------------------------- every candidate config gives the same bits (CPU interpreter)
# A shipped choice is one of the kernel's candidates, so it changes results only if two candidates differ. The
# amax, 16×16 weight, operand and MXFP8 columns kernels are pinned in test_kernels.py / test_kernels_mxfp8.py;
# here the SwiGLU pair, the dequantization and the MXFP8 row+column kernel. The GEMMs' tiles change the fp32
# sums' blocking, which the interpreter's numpy dot does not share with the tensor cores: on a GPU below.

class _Always(dict):
    """An autotuner cache that answers one config for every key (each candidate in turn, no benchmark)."""

    def __init__(self, config):
        super().__init__()
        self.config = config

    def __contains__(self, key):
        return True

    def __getitem__(self, key):
        return self.config


def _per_config(monkeypatch, tuner, run):
    """run() once per config of ``tuner``, every autotuned launch of it taking that config."""
    outs = []
    for config in tuner.configs:
        monkeypatch.setattr(tuner, "cache", _Always(config))
        outs.append((config, [t.clone() for t in run()]))
    return outs


def _same(outs, want):
    for config, got in outs:
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), config


def test_swiglu_kernels_every_config_same_bits(monkeypatch):
    from titan_nvfp4.kernels import quantize as q
    from titan_nvfp4.kernels import swiglu as sw
    from titan_nvfp4.numerics.rht import rht_signs

    gen = torch.Generator().manual_seed(7)
    M, N = 48, 128  # a partial row tile (G 2: 32 rows), the largest BK
    h1, h3, dh = (torch.randn(M, N, generator=gen).bfloat16().to(DEV) * 3 for _ in range(3))
    h1[5, 7] = float("inf")
    offsets = torch.tensor([16, 16, 48], dtype=torch.int32, device=DEV)
    signs = rht_signs(0, DEV)
    fwd = lambda: sw.swiglu_amax_tensors(h1, h3, offsets, True, signs)  # noqa: E731
    bwd = lambda: sw.swiglu_backward_amax_tensors(dh, h1, h3, offsets, True, signs)  # noqa: E731
    want_f, want_b = [t.clone() for t in fwd()], [t.clone() for t in bwd()]  # the interpreter's fixed tiles
    monkeypatch.setattr(q, "_tuned", lambda x: True)  # the autotuned launch, as on a GPU
    _same(_per_config(monkeypatch, sw._fwd_autotuned, fwd), want_f)
    _same(_per_config(monkeypatch, sw._bwd_autotuned, bwd), want_b)


def test_dequant_kernel_every_config_same_bits():
    args, kw, out, want = _dequant_call()
    for config in g._dequant_autotuned.configs:
        out.zero_()
        br, bc = config.kwargs["BR"], config.kwargs["BC"]
        g._dequant_kernel[(L.cdiv(args[3], br), L.cdiv(args[4] // 2, bc))](*args, **kw, **config.all_kwargs())
        assert torch.equal(out.view(torch.int16), want.view(torch.int16)), config


@pytest.mark.parametrize("staged", [False, True])
def test_mxfp8_kernel_every_config_same_bits(staged):
    from titan_nvfp4.kernels import mxfp8 as k

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(72, 256, generator=gen) * torch.exp(torch.randn(72, 1, generator=gen) * 3)
    x[3, 9] = float("nan")
    x = x.to(DEV)
    M, K, Mpad = 72, 256, 96
    want = k.quantize_mxfp8_tensors(x, True, True, staged)
    for config in k._mxfp8_autotuned.configs:
        got = [torch.full_like(t.view(torch.uint8), 0x55).view(t.dtype) for t in want]
        rd, rs, cd, cs = got[0], got[1].view(torch.uint8), got[2], got[3].view(torch.uint8)
        bm, bk = config.kwargs["BM"], config.kwargs["BK"]
        k._mxfp8_kernel[(L.cdiv(Mpad, bm), L.cdiv(K, bk))](
            x, M, K, x.stride(0), x.stride(1), rd, rs, cd, cs, Mpad, ROW=True, COL=True, STAGED=staged, HW=k.hardware_e4m3(x.device),
            **config.all_kwargs())
        for a, b in zip(got, want):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), config


@pytest.mark.skipif(not GPU, reason="the GEMMs' tiles run on tensor cores")
def test_gemm_kernels_every_config_same_bits_on_gpu(monkeypatch):
    """Each config of every GEMM autotuner gives the bits of the others on random (inexact) operands: the tiles
    split M, N and K differently, the tensor cores sum each output's K steps in the same order."""
    from titan_nvfp4.kernels import grouped_gemm as gg

    gen = torch.Generator().manual_seed(5)
    a = quantize_nvfp4(torch.randn(2048 + 48, 2048, generator=gen).cuda().bfloat16())
    b = quantize_nvfp4(torch.randn(1536 + 16, 2048, generator=gen).cuda().bfloat16(), block_shape=(16, 16))
    T, K, N, E = 4096, 1024, 1408, 8
    ends = torch.tensor([0, 512, 1040, 1040, 2048, 2064, 3200, 4000], dtype=torch.int32).cuda()
    a16 = torch.randn(T, K, generator=gen).half().cuda()
    w16 = torch.randn(E * N, K, generator=gen).half().cuda()
    gs = torch.rand(E + 1, generator=gen).cuda() + 0.5
    x_t, dy_t = torch.randn(K, T, generator=gen).half().cuda(), torch.randn(N, T, generator=gen).half().cuda()

    def run():
        outs = [g.nvfp4_gemm_triton(a, b, torch.float32, autotune=True, use_tma=tma, stage_a=sa)
                for tma in (False, True) for sa in (False, True)]
        for kind in ("persistent", "tiles"):
            monkeypatch.setattr(gg, "ROWS_KERNEL", kind)
            outs.append(gg.grouped_gemm_rows(a16, w16, ends, gs, gs, N, N, 0, torch.bfloat16))
        outs.append(gg.grouped_gemm_tokens(x_t, dy_t, ends, gs, gs, torch.float32))
        outs.append(gg.grouped_gemm_tokens(dy_t, x_t, ends, gs, gs, torch.float32))  # swapped operands
        return outs

    want = [t.clone() for t in run()]
    for tuner in (g._nvfp4_gemm_autotuned, g._nvfp4_gemm_persistent_autotuned, gg._rows_autotuned,
                  gg._rows_persistent_autotuned, gg._tokens_autotuned):
        saved = tuner.cache
        _same(_per_config(monkeypatch, tuner, run), want)
        monkeypatch.setattr(tuner, "cache", saved)
