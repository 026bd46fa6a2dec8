"""The new presets (quartet2, tetrajet2) and their knobs through every way a user sets them: the TOML job file
(TorchTitan 0.2), the comparison runner's spec, the plain API; bad values refused at parse time naming the key and
the value; the routed experts refuse the dense-only fields, set there or by a preset."""

from __future__ import annotations

from pathlib import Path

import pytest

from titan_nvfp4 import NVFP4Recipe, compare
from titan_nvfp4.recipe.nvfp4_recipe import build_recipe
from job_helpers import edited_toml, parse

REPO = Path(__file__).resolve().parents[1]


def test_the_presets_hold_what_their_sources_ran():
    q = build_recipe("quartet2", {})
    assert (q.ms_eden, q.rht_size, q.weight_2d, q.block_scale_rule, q.stochastic_rounding) == (
        True, 128, False, "four_over_six", False)
    t = build_recipe("tetrajet2", {})
    assert (t.osci_reset_every, t.osci_reset_window, t.osci_reset_threshold, t.osci_reset_start_fraction) == (
        200, 50, 8.0, 0.6)
    assert (t.outcontrol_fraction, t.outcontrol_start, t.outcontrol_steps) == (0.1, 500, 50)
    assert build_recipe("tetrajet2", {"osci_reset_every": 0, "osci_reset_start_fraction": 0.0}).osci_reset_every == 0
    assert build_recipe("quartet2", {}).outcontrol_fraction == 0 and build_recipe("quartet2", {}).osci_reset_every == 0


@pytest.mark.parametrize("lines, needle", [
    (('ms_eden = true',), "[quantize.linear.nvfp4] ms_eden = true replaces stochastic rounding of the gradients"),
    (('ms_eden = true', 'stochastic_rounding = false', 'rht = false'), "ms_eden = true needs rht = true"),
    (('rht_size = 64',), "[quantize.linear.nvfp4] rht_size = 64 needs ms_eden = true"),
    (('rht_size = 48',), "[quantize.linear.nvfp4] rht_size must be one of [16, 32, 64, 128], got 48"),
    (('ms_eden = 1',), "[quantize.linear.nvfp4] ms_eden must be true or false, got 1"),
    (('osci_reset_window = 3',), "[quantize.linear.nvfp4] osci_reset_window = 3 needs osci_reset_every > 0"),
    (('osci_reset_every = 30', 'osci_reset_start_fraction = 0.6'),
     "osci_reset_every = 30 needs to be at least osci_reset_window + 2 = 52"),
    (('ms_eden = true', 'stochastic_rounding = false', 'backward = "mxfp8"'), "ms_eden = true quantizes an NVFP4 backward; backward = 'mxfp8'"),
])
def test_bad_values_stop_the_parse_naming_key_and_value(tmp_path, lines, needle):
    with pytest.raises(ValueError) as e:
        parse(toml=edited_toml(tmp_path, add=lines))
    assert needle in str(e.value), str(e.value)


def test_the_experts_refuse_it_from_a_preset_by_name(tmp_path):
    path = edited_toml(tmp_path)
    path.write_text(path.read_text() + '[quantize.grouped_mm.nvfp4]\nrecipe = "quartet2"\n')
    with pytest.raises(ValueError, match=r"\[quantize.grouped_mm.nvfp4\] ms_eden = true \(from the recipe 'quartet2'\): "
                                         "the grouped GEMMs have no MS-EDEN backward yet"):
        parse(toml=path)
    assert isinstance(NVFP4Recipe(ms_eden=True, stochastic_rounding=False), NVFP4Recipe)


def test_the_comparison_runner_spec_of_the_new_presets_parses_through_torchtitan(monkeypatch):
    """configs/compare/recipe_frontier_debug.toml: every arm's job file plus overrides parses with TorchTitan's own
    ConfigManager into the recipe the arm names."""
    monkeypatch.chdir(REPO)
    spec = compare.load_spec(REPO / "configs/compare/recipe_frontier_debug.toml")
    assert [a.name for a in spec.arms] == ["bf16", "nvidia_paper", "quartet2", "tetrajet2", "switch_forward"]
    got = {}
    for arm in spec.arms[1:]:
        cmd = spec.command(arm)
        job_args = cmd[cmd.index("--job.config_file"):]
        cfg = parse(*job_args[2:], toml=Path(job_args[1]))
        got[arm.name] = cfg.quantize.linear.nvfp4.build_recipe()
    assert got["quartet2"].ms_eden and got["quartet2"].rht_size == 128
    assert got["tetrajet2"].osci_reset_every == 200 and not got["nvidia_paper"].ms_eden
