"""titan_nvfp4.tools.memory_peak: the live set at a step's peak, replayed backwards from a CUDA memory snapshot's
live blocks through its allocation history, charged to the code that allocated each block. Synthetic snapshots in
torch's format (segments with blocks, device_traces of alloc / free events with frames) against peaks worked out by
hand; torch records CUDA allocations only, so a real snapshot is read on a GPU."""

from __future__ import annotations

import pickle

import pytest
import torch

from titan_nvfp4.tools.memory_peak import main, peak, site

MIB = 2**20


def frames(path: str, line: int = 1, name: str = "f") -> list[dict]:
    """A frame list as torch records it, innermost first, under torch's own frames."""
    return [{"filename": "/venv/lib/python3.12/site-packages/torch/_ops.py", "line": 9, "name": "__call__"},
            {"filename": path, "line": line, "name": name},
            {"filename": "/venv/lib/python3.12/site-packages/torchtitan/train.py", "line": 542, "name": "train_step"}]


W = frames("/venv/lib/python3.12/site-packages/torchtitan/models/moe/moe.py", 10, "forward")  # a weight, say
ACT = frames("/repo/titan_nvfp4/ops/grouped.py", 20, "quantize_experts")
TMP = frames("/repo/titan_nvfp4/kernels/gemm.py", 30, "stage")


def snapshot(live_blocks, events) -> dict:
    """One segment holding ``live_blocks`` [(size, frames)] as allocated blocks (addresses 0, size0, ...) followed by
    a free block; ``events`` [(action, addr, size, frames)]."""
    blocks, addr = [], 0
    for size, fr in live_blocks:
        blocks.append({"size": size, "state": "active_allocated", "frames": fr})
        addr += size
    blocks.append({"size": 512 * MIB, "state": "inactive", "frames": []})
    return {"segments": [{"device": 0, "address": 0, "total_size": addr + 512 * MIB, "blocks": blocks}],
            "device_traces": [[{"action": a, "addr": ad, "size": sz, "frames": fr} for a, ad, sz, fr in events]]}


# at the end: W (100 MiB at 0) and an activation (50 MiB at 100 MiB) live. The window: the activation allocated,
# a 200 MiB temporary allocated at 150 MiB and freed, a 30 MiB block from before the window freed (at 400 MiB).
END = [(100 * MIB, W), (50 * MIB, ACT)]
EVENTS = [("alloc", 100 * MIB, 50 * MIB, ACT),
          ("alloc", 150 * MIB, 200 * MIB, TMP),
          ("free_requested", 150 * MIB, 200 * MIB, TMP),  # not counted: the free completes below
          ("free_completed", 150 * MIB, 200 * MIB, TMP),
          ("free_completed", 400 * MIB, 30 * MIB, ACT)]


def test_the_peak_is_the_largest_live_set_in_the_window_and_is_charged_to_its_allocations():
    p = peak("nvfp4", snapshot(END, EVENTS))
    assert p.total == 380 * MIB  # W + activation + temporary + the block from before the window
    assert p.at_event == 2 and p.events == 4  # after the temporary's alloc (free_requested is not a state change)
    by = {k.split(" ")[0]: v for k, v in p.by_site.items()}
    assert by["torchtitan/models/moe/moe.py:10"] == (100 * MIB, 1)
    assert by["titan_nvfp4/ops/grouped.py:20"] == (50 * MIB, 1)
    assert by["titan_nvfp4/kernels/gemm.py:30"] == (200 * MIB, 1)
    assert by["no"] == (30 * MIB, 1)  # allocated before the history: no frames to charge
    assert p.notes == []


def test_the_end_state_can_be_the_peak_and_mismatches_are_noted():
    p = peak("bf16", snapshot(END, [("alloc", 100 * MIB, 50 * MIB, ACT)]))
    assert p.total == 150 * MIB and p.at_event == 1
    q = peak("x", snapshot(END, [("alloc", 999 * MIB, 1 * MIB, TMP)]))  # an alloc of a block not live at the end
    assert q.notes and "did not match" in q.notes[0]


def test_site_prefers_our_and_torchtitans_frames_then_any_python_outside_torch():
    assert site(ACT) == "titan_nvfp4/ops/grouped.py:20 quantize_experts"
    assert site(frames("/home/u/train.py", 5, "main")[:2]) == "/home/u/train.py:5 main"
    assert site([]).startswith("no Python frame")


def test_cli_tables_both_arms_with_the_difference(tmp_path, capsys):
    a, b, out = tmp_path / "bf16.pickle", tmp_path / "nvfp4.pickle", tmp_path / "peak.md"
    a.write_bytes(pickle.dumps(snapshot(END[:1], [("alloc", 0, 100 * MIB, W)])))
    b.write_bytes(pickle.dumps(snapshot(END, EVENTS)))
    assert main([str(a), str(b), "--top", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "## bf16: peak 0.10 GiB live" in text
    assert "## nvfp4: peak 0.37 GiB live, at event 2 of 4; +0.27 GiB against bf16" in text
    assert "| `titan_nvfp4/kernels/gemm.py:30 stage` | 0.195 | 1 | 52.6% |" in text
    assert "| 2 other sites | 0.078 | 2 | 21.1% |" in text  # --top 2: the activation and the older block summed
    assert out.read_text() == text


@pytest.mark.parametrize("content,needle", [(b"not a pickle", "cannot read"),
                                            (pickle.dumps({"x": 1}), "not a CUDA memory snapshot"),
                                            (pickle.dumps({"segments": [], "device_traces": [[]]}),
                                             "no allocation history")])
def test_bad_snapshots_are_named(tmp_path, capsys, content, needle):
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(content)
    with pytest.raises(SystemExit) as e:
        main([str(bad)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and "bad.pickle" in err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch records CUDA allocations only")
def test_a_real_snapshot_reads():
    torch.cuda.memory._record_memory_history(max_entries=1000)
    try:
        x = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
        y = torch.empty(32 * MIB, dtype=torch.uint8, device="cuda")
        del y
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    p = peak("gpu", snap, torch.cuda.current_device())
    assert p.total >= 96 * MIB and any("test_memory_peak.py" in k for k in p.by_site)
    del x
