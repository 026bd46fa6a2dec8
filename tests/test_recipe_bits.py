"""scripts/recipe_bits.py: records an NVFP4Linear's forward and backward bits and tells two recordings apart."""

import importlib.util
from pathlib import Path

import pytest
import torch

from titan_nvfp4.kernels.platform import interpreting

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("recipe_bits", ROOT / "scripts" / "recipe_bits.py")
recipe_bits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recipe_bits)


def test_the_same_code_records_the_same_bits_and_a_changed_bit_is_reported(tmp_path, capsys):
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    assert recipe_bits.main([str(a)]) == 0 and recipe_bits.main([str(b)]) == 0
    assert recipe_bits.main(["--compare", str(a), str(b)]) == 0
    assert "18 of 18 tensors bit-identical" in capsys.readouterr().out
    rec = torch.load(b)
    dw = rec["torch.bfloat16_2_dw"].view(torch.int16)
    dw.view(-1)[7] ^= 1  # one ulp of one gradient element
    torch.save(rec, b)
    assert recipe_bits.main(["--compare", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "torch.bfloat16_2_dw" in out and "17 of 18" in out


def test_the_recording_covers_forward_and_backward_of_each_dtype_and_step():
    rec = recipe_bits.record(steps=2)
    assert sorted(rec) == sorted(f"{dt}_{step}_{k}" for dt in (torch.float32, torch.bfloat16) for step in range(2)
                                 for k in ("y", "dx", "dw"))
    assert rec["torch.bfloat16_1_dw"].dtype == torch.bfloat16 and rec["torch.float32_0_y"].shape == (256, 384)
    assert not torch.equal(rec["torch.float32_0_dw"], rec["torch.float32_1_dw"])  # each step its own inputs


interpreted = pytest.mark.skipif(not interpreting(),
                                 reason="the experts' recording runs Triton on the CPU: TRITON_INTERPRET=1")


@interpreted
def test_the_experts_recording_covers_both_blocks_and_repeats_bit_for_bit():
    a = recipe_bits.record_experts(steps=1)
    grads = {"swiglu": ("w1", "w2", "w3"), "gpt_oss": ("mlp1_weight", "mlp1_bias", "mlp2_weight", "mlp2_bias")}
    want = [f"{b}_0_{k}" for b, names in grads.items() for k in ("y", "dx", *(f"d{n}" for n in names))]
    assert sorted(a) == sorted(want)
    rows = sum(recipe_bits.EXPERT_COUNTS)
    assert a["swiglu_0_y"].shape == (rows, 256) and a["swiglu_0_dw1"].shape == (8, 176, 256)
    empty = recipe_bits.EXPERT_COUNTS.index(0)  # an expert with no tokens gets no gradient
    assert not a["swiglu_0_dw2"][empty].any() and a["swiglu_0_dw2"][empty - 1].abs().sum() > 0
    assert not a["gpt_oss_0_dmlp1_weight"][empty].any()
    b = recipe_bits.record_experts(steps=1)
    assert all(torch.equal(a[k], b[k]) for k in a)


@interpreted
def test_a_file_names_what_it_recorded_and_only_like_files_are_compared(tmp_path, capsys):
    lin, exp = tmp_path / "linear.pt", tmp_path / "experts.pt"
    assert recipe_bits.main([str(lin)]) == 0 and recipe_bits.main(["--experts", str(exp)]) == 0
    assert torch.load(exp)[recipe_bits.WHAT] == "experts, backend reference"
    assert recipe_bits.main(["--compare", str(exp), str(exp)]) == 0
    assert "33 of 33 tensors bit-identical" in capsys.readouterr().out
    assert recipe_bits.main(["--compare", str(lin), str(exp)]) == 2
    assert "linear" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["experts.pt", "linear.pt"]  # no .partial left


def test_bad_arguments_are_refused_and_a_failed_recording_writes_nothing(tmp_path, monkeypatch):
    out = tmp_path / "x.pt"
    with pytest.raises(SystemExit):
        recipe_bits.main(["--backend", "emulated", str(out)])
    with pytest.raises(SystemExit):
        recipe_bits.main(["--compare", "--experts", str(out), str(out)])

    def fail(obj, path):
        Path(path).write_bytes(b"half a recording")
        raise OSError("disk full")

    monkeypatch.setattr(recipe_bits.torch, "save", fail)
    with pytest.raises(OSError):
        recipe_bits.main([str(out)])
    assert list(tmp_path.iterdir()) == []
