"""Where the package data is found: an install (CI's wheel check covers wheels) or a bare source tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SOURCE_TREE = f"""
import sys
# no installed copy or editable finder: the checkout on sys.path only, as the GPU machines run it
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path_hooks[:] = [h for h in sys.path_hooks if "editable" not in repr(h).lower()]
sys.path.insert(0, {str(REPO)!r})
import titan_nvfp4
from titan_nvfp4.recipe.nvfp4_recipe import build_recipe, shipped_compare_specs
assert titan_nvfp4.__file__.startswith({str(REPO)!r}), titan_nvfp4.__file__
print(sorted(titan_nvfp4.available_presets()), sorted(shipped_compare_specs()))
print(build_recipe("nvidia_paper_selective", {{}}).bf16_last_blocks)
"""


def test_presets_and_specs_are_found_from_a_source_tree_on_pythonpath(tmp_path):
    r = subprocess.run([sys.executable, "-c", SOURCE_TREE], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["['naive_rtn', 'nvidia_paper', 'nvidia_paper_selective', 'quartet2', 'tetrajet2'] ['gpt_oss_memorize', 'llama3_2b_pysources', 'llama3_debug', 'recipe_frontier_debug', 'recipe_ranking_386m']", "8"]


def test_every_preset_and_spec_is_package_data():
    import titan_nvfp4
    from titan_nvfp4.recipe.nvfp4_recipe import shipped_compare_specs

    on_disk = sorted(p.stem for p in (REPO / "configs").glob("*.toml"))
    assert titan_nvfp4.available_presets() == on_disk
    assert sorted(shipped_compare_specs()) == sorted(p.stem for p in (REPO / "configs/compare").glob("*.toml"))
