"""Loss-convergence comparisons in one command: arms of TorchTitan overrides on one base job file, run
with the same seed and data one after another, then a table, a CSV and a plot.

    python -m titan_nvfp4.compare configs/compare/llama3_debug.toml [--only ARM ...] [--rerun] [--report-only] [--out DIR]
    python -m titan_nvfp4.compare llama3_debug          # a spec shipped with the package, by name
    python -m titan_nvfp4.compare SPEC --import-logs logs.tar.xz [--replace-logs]   # logs from another machine

Job-file paths in a spec are relative to the current directory: run it from a titan-nvfp4 checkout.

The spec (TOML):

    [compare]
    base = "train_configs/llama3_nvfp4.toml"   # the job file every arm starts from
    steps = 1000                               # --training.steps of every arm
    out = "outputs/compare/llama3_debug"       # logs, table, CSV and plot
    last = 20                                  # logged steps averaged for the final loss
    baseline = "bf16"                          # Δ is against this arm (default: the first)
    reference = "nvfp4"                        # optional: the gap baseline–reference each arm closes
    common = ["--metrics.log_freq", "10"]      # overrides for every arm
    launcher = ["torchrun", "--standalone", "--nproc_per_node=1", "-m", "torchtitan.train"]   # the default (a free port each)
    timeout_s = 0                              # per arm (0: none)
    mode = "compile+cudagraphs"                # or "compile", or "eager" (an arm may set its own); see Modes
    parallel = 1                               # arms at once, each on its own GPU (arm slot i on GPU i % GPUs)
    checkpoint_interval = 0                    # > 0: checkpoint every N steps; running the spec again resumes
    module = ""                                # TorchTitan 0.3: the config registry; base names are its configs
    paired_validations = 1                     # the paired table's statistic: the mean of each run's last K validations
    corpus = ""                                # a corpus id every arm must read ($TITAN_NVFP4_CORPUS): "" any
    target_se = 0                              # > 0: the paired table checks each gap's s.e. against it (points)

    [[arm]]
    name = "bf16"
    base = "train_configs/llama3_bf16.toml"    # an arm may start from another job file
    [[arm]]
    name = "nvfp4"                             # no overrides: the base job as it is
    [[arm]]
    name = "no_rht"
    overrides = ["--quantize.linear.nvfp4.rht", "False"]
    [[arm]]
    name = "quartet2"                          # seed replicates: arms quartet2, quartet2_seed2, quartet2_seed3
    overrides = ["--quantize.linear.nvfp4.recipe", "quartet2"]
    seeds = [42, 43, 44]                       # each adds --debug.seed S (none for the job file's own seed)
    [[arm]]
    name = "switch"                            # starts from nvfp4's checkpoint of step 500 (the same seed's)
    overrides = ["--quantize.linear.nvfp4.bf16_after_fraction", "0.4"]
    branch_from = "nvfp4"
    branch_step = 500                          # a multiple of checkpoint_interval (> 0), below steps

Modes: ``compile+cudagraphs`` (the fastest on a GPU) runs each arm with ``--compile.enable`` and
TORCHINDUCTOR_CUDAGRAPHS=1 (Inductor's CUDA graph trees, which remove the host time of the NVFP4 launches);
``compile`` without the graphs; ``eager`` neither. ``--mode`` on the command line overrides the spec's. With no
mode given an arm runs ``compile+cudagraphs``.

With ``parallel = N`` (or ``--parallel N``) N arms train at once, slot i pinned to visible GPU i modulo the
GPU count (several slots may share a GPU). With ``checkpoint_interval = N`` each arm checkpoints every N steps
under its dump folder (TorchTitan's DCP: model, optimizer, schedule, data position), and an arm stopped
before ``steps`` (``timeout_s``, a lost machine) resumes from its latest checkpoint when the spec runs again,
its log continued; later log lines for a step win. ``timeout_s`` stops all of an arm's processes.

Branches: an arm with ``branch_from`` and ``branch_step`` starts from that arm's (with seeds: the replicate of the
same seed's) checkpoint of that step, the whole training state (``--checkpoint.initial_load_path``,
``--checkpoint.no_initial_load_model_only``), so the two share every bit up to it and differ by what the branch
changes after it, not by the drift of two separate runs. After the step a branch trains with the spec's base (or its
own) and its own overrides, not its parent's: repeat the parent's overrides where it should differ by one knob. The
runner keeps the parent's checkpoint of that step as hard links under ``<out>/<parent>/branch/`` while the parent
trains (TorchTitan keeps only its latest two), runs the branches after every other arm, and writes into a branch's
log the length and sha256 of its parent's log at that moment: a branch whose parent's log is another run, or not a
run of the spec as it is now, is stale. The checkpoint stays on the machine: a branch runs in
the same call as its parent (or later on the same machine), else it is refused.

TorchTitan 0.3 (a config registry instead of job files): ``module = "titan_nvfp4.integration_v03.configs"``, and
each ``base`` names a config of it (``base = "llama3_debug_nvfp4"``); an arm runs ``--module M --config BASE``.

Seed replicates: an arm with ``seeds = [s1, s2, ...]`` stands for arms "<name>", "<name>_seed2", ..., one per seed,
each with ``--debug.seed s`` after its overrides (left out where s is the job file's ``[debug] seed``, so that the
first replicate is the plain arm). Arms named that way by hand count alike; an arm's seed is its last
``--debug.seed``, else its job file's. When a recipe besides the baseline's has two seeds paired with it, the table
adds a paired one (docs/results.md, "Ranking protocol"): per recipe, over the seeds it shares with the baseline's
recipe, the mean of the per-seed gaps in % of the baseline ± s.d./√n, and the share of the reference recipe's gap it
closes, the ratio of the mean paired differences ± its delta-method standard error; each run's statistic is the mean
of its last ``paired_validations`` validation losses, and a run below ``steps`` waits out of it. With ``target_se``
a line under it gives each gap's standard error against that target and, while above it, the seeds the direct
paired gap needs at the spread seen so far.

Each arm's log starts with its variables and full command, then a line with the arm's spec hash (its command
with the dump folder aside, its mode's variables and its job file's sha256). An arm whose log is a run of this
spec that reached ``steps`` is not run again; one whose log ran another spec (an edited override, fewer steps,
another mode, an edited job file) is refused, naming the arm and what changed, and so is a log without a spec
line or one that mixes two runs; ``--rerun`` runs the arms afresh, each one's log and dump folder (TensorBoard
events, checkpoints) removed first (``--only`` picks arms). The table shows only logs of this spec: partial
ones flagged, stale or mixed ones left out and named, an older runner's log (no spec line) flagged as unchecked.
Each split a job reads from an assets folder logs that folder's corpus id: an arm whose log names another corpus
than the baseline's is left out of the table, one whose log names two for a split is mixed, and under ``corpus``
one on another corpus, or one that trained without naming any, is stale (refused; ``--rerun`` runs it on the
pinned one).

Each arm is locked (``<out>/.<arm>.lock``, with the owner's pid) while a runner runs it: a second runner of the
arm is refused by name, and a lock whose owner died is taken over with a note. The trainer runs under a guard
process that stops its whole tree (torchrun's workers included) when the runner ends by any signal, SIGKILL
too; SIGINT, SIGTERM and SIGHUP stop the runner and its arms. A process left writing an arm's log keeps the arm
from running until it is stopped. Losses come from the arm's log (TorchTitan's metric lines,
tools/loss_log.py); when the log has none (a job that logs elsewhere) from the TensorBoard events under its dump
folder (``--metrics.enable_tensorboard``). The table, CSV and plot are written atomically.
W&B: add ``--metrics.enable_wandb`` to ``common``; ``wandb_offline = true`` in ``[compare]`` sets
WANDB_MODE=offline, which needs no network.
"""

from .armlog import ArmLog, arm_metrics, is_done, read_arm_log
from .cli import PROG, main, resolve_spec
from .runner import run_arm, run_arms
from .spec import DEFAULT_LAUNCHER, DEFAULT_MODE, MODES, Arm, Spec, check_arm_args, load_spec
from .table import report

__all__ = ["DEFAULT_LAUNCHER", "DEFAULT_MODE", "MODES", "PROG", "Arm", "ArmLog", "Spec", "arm_metrics",
           "check_arm_args", "is_done", "load_spec", "main", "read_arm_log", "report", "resolve_spec", "run_arm",
           "run_arms"]
