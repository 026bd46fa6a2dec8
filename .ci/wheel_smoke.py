"""What a user of the built wheel gets, checked from outside the checkout (CI runs it after the suite).

    python .ci/wheel_smoke.py             # in a venv with the wheel and its dependencies installed
    python .ci/wheel_smoke.py --resources # any Python 3.10+, the wheel installed with --no-deps (no torch)

Full mode: titan_nvfp4 comes from site-packages, every module imports, every shipped preset resolves
through TorchTitan's own job-config parser (both sections), every shipped comparison spec parses, and
every CLI prints its help. --resources: the presets and specs are found through importlib.resources on
this Python, without importing torch.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import pkgutil
import runpy
import sys
import types
import warnings
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
CLIS = ["titan_nvfp4.compare", "titan_nvfp4.tools.loss_log", "titan_nvfp4.tools.loss_plot",
        "titan_nvfp4.tools.e2e_report", "titan_nvfp4.tools.export_dense", "titan_nvfp4.tools.export_hf",
        "titan_nvfp4.tools.emulated_dp",
        "titan_nvfp4.data.prepare"]
IMPORT_BUILDS_DATA = {"titan_nvfp4.data.prepare"}  # importing it builds the corpus (TorchTitan's custom_import)


def check(cond: bool, what: str) -> None:
    if not cond:
        sys.exit(f"wheel_smoke: FAILED: {what}")


def installed_package_dir() -> Path:
    spec = importlib.util.find_spec("titan_nvfp4")
    check(spec is not None and spec.origin is not None, "titan_nvfp4 is not installed")
    pkg = Path(spec.origin).parent
    check(CHECKOUT not in pkg.parents, f"titan_nvfp4 imported from the checkout ({pkg}), not from the wheel")
    return pkg


def resources_only() -> None:
    pkg = installed_package_dir()
    stub = types.ModuleType("titan_nvfp4")  # the real __init__ imports torch; the data lookup must not need it
    stub.__path__ = [str(pkg)]
    sys.modules["titan_nvfp4"] = stub
    from titan_nvfp4.configs import shipped

    presets, specs = shipped(), shipped("compare")
    check({"nvidia_paper", "nvidia_paper_selective", "naive_rtn"} <= set(presets), f"presets found: {sorted(presets)}")
    check("llama3_debug" in specs, f"comparison specs found: {sorted(specs)}")
    for f in [*presets.values(), *specs.values()]:
        check(len(f.read_bytes()) > 0, f"{f.name} is empty")
    tables = sorted(p.name for p in (pkg / "kernels" / "tuned").glob("*.json"))
    check("sm90.json" in tables, f"shipped autotuning tables in the wheel: {tables}")
    print(f"wheel_smoke --resources: Python {sys.version.split()[0]}: presets {sorted(presets)}, specs {sorted(specs)}")


def full() -> None:
    pkg = installed_package_dir()
    import titan_nvfp4

    from titan_nvfp4.integration_common.torchtitan_version import INTEGRATIONS, installed_generation

    # the integration of the other TorchTitan generation refuses to import, naming the installed one
    other = [p for g, p in INTEGRATIONS.items() if g != installed_generation()]
    modules = [m.name for m in pkgutil.walk_packages(titan_nvfp4.__path__, "titan_nvfp4.")]
    for name in modules:
        if any(name == p or name.startswith(p + ".") for p in other):
            with contextlib.suppress(ImportError):
                importlib.import_module(name)
                check(False, f"{name} imported beside torchtitan {installed_generation()}")
        elif name not in IMPORT_BUILDS_DATA:
            importlib.import_module(name)
    for sub in ("kernels", "distributed", "integration", "integration_v03", "numerics", "ops", "tools", "data", "configs"):
        check(f"titan_nvfp4.{sub}" in modules, f"titan_nvfp4.{sub} missing from the wheel")
    check(any(pkg.parent.glob(f"titan_nvfp4-{titan_nvfp4.__version__}.dist-info/licenses/LICENSE")),
          "LICENSE missing from the wheel")

    from torchtitan.config import ConfigManager

    presets = titan_nvfp4.available_presets()
    check({"nvidia_paper", "nvidia_paper_selective", "naive_rtn"} <= set(presets), f"presets: {presets}")
    from titan_nvfp4.recipe.nvfp4_recipe import build_recipe, dense_only_values

    for name in presets:
        # a preset with dense-only fields (quartet2's ms_eden, tetrajet2's OsciReset) goes to the dense section only:
        # the experts' section refuses it by name (tests/test_recipe_presets.py)
        both = not dense_only_values(build_recipe(name, {}))
        config = ConfigManager().parse_args([
            "--job.custom_config_module", "titan_nvfp4.integration.job_config",
            "--model.converters", "quantize.linear.nvfp4,quantize.grouped_mm.nvfp4",
            "--quantize.linear.nvfp4.recipe", name,
            *(["--quantize.grouped_mm.nvfp4.recipe", name] if both else [])])
        dense = config.quantize.linear.nvfp4.build_recipe()
        experts = config.quantize.grouped_mm.nvfp4.build_recipe()
        check(not both or dense == experts, f"preset {name}: the two sections resolve differently")
        check(dense == build_recipe(name, {}), f"preset {name}: the job file resolves otherwise than build_recipe")
        print(f"wheel_smoke: preset {name} -> {dense}" + ("" if both else " (dense section only)"))

    from titan_nvfp4.compare import load_spec, resolve_spec
    from titan_nvfp4.recipe.nvfp4_recipe import shipped_compare_specs

    os.chdir(CHECKOUT)  # a spec's job-file paths are relative to a checkout
    for name in shipped_compare_specs():
        spec = load_spec(resolve_spec(name))
        check(len(spec.arms) >= 2, f"spec {name}: {len(spec.arms)} arms")
        print(f"wheel_smoke: comparison spec {name}: {len(spec.arms)} arms")

    for cli in CLIS:  # in this process: the modules are imported already
        out, sys.argv = io.StringIO(), [cli, "--help"]
        with contextlib.redirect_stdout(out), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported above
            try:
                runpy.run_module(cli, run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as e:
                code = e.code or 0
        check(code == 0 and f"python -m {cli}" in out.getvalue(), f"{cli} --help: exit {code}: {out.getvalue()[-300:]}")
    print(f"wheel_smoke: {len(modules)} modules import from {pkg}; {len(CLIS)} CLIs print their help")


if __name__ == "__main__":
    resources_only() if "--resources" in sys.argv[1:] else full()
