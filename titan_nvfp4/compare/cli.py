"""``python -m titan_nvfp4.compare``: the command line (its usage is the package's docstring)."""

from __future__ import annotations

import signal
import sys
import tempfile
from pathlib import Path

from ..recipe import shipped_compare_specs
from ..tools.cli import fail, parser
from .importer import import_logs
from .runner import Refused, run_selected
from .spec import DEFAULT_MODE, MODES, check_arm_args, load_spec
from .table import report

PROG = "python -m titan_nvfp4.compare"


def resolve_spec(name: str) -> Path:
    """A spec file: ``name`` if it is a file, else the shipped spec of that name (configs/compare/<name>.toml)."""
    path = Path(name)
    if path.is_file():
        return path
    if path.is_dir():
        fail(PROG, f"spec {name} is a folder; give a .toml file")
    shipped = shipped_compare_specs()
    if name not in shipped:
        fail(PROG, f"no such spec file: {name} (shipped specs: {', '.join(sorted(shipped))})")
    if isinstance(shipped[name], Path):
        return shipped[name]
    copy = Path(tempfile.mkdtemp(prefix="titan_nvfp4_compare_")) / shipped[name].name  # a zipped install
    copy.write_bytes(shipped[name].read_bytes())
    return copy


def main(argv: list[str] | None = None) -> int:
    ap = parser("titan_nvfp4.compare", sys.modules[__package__].__doc__)
    ap.allow_abbrev = False  # scripts/compare_on_device.sh reads --out as spelled out: no other spelling may move it
    ap.add_argument("spec", help="a comparison spec (.toml file), or the name of a shipped one: "
                                 + ", ".join(sorted(shipped_compare_specs())))
    ap.add_argument("--only", nargs="+", default=None, metavar="ARM", help="run these arms and no others")
    ap.add_argument("--rerun", action="store_true",
                    help="run the arms afresh: each one's log and dump folder (events, checkpoints) removed first")
    ap.add_argument("--timeout-s", type=float, default=None, metavar="S",
                    help="stop each arm after S seconds, instead of the spec's timeout_s (a checkpointed arm resumes later)")
    ap.add_argument("--report-only", action="store_true", help="write the table and plot from existing logs")
    ap.add_argument("--import-logs", type=Path, default=None, metavar="SOURCE",
                    help="bring the arms' logs from SOURCE (a tar archive such as a device call's logs.tar.xz, or a "
                         "folder) into the output folder, each only if it is a run of this spec that continues the log "
                         "there (or finds none); then write the table (no arm runs)")
    ap.add_argument("--replace-logs", action="store_true",
                    help="with --import-logs: let an incoming log replace one of another run of the arm (never a "
                         "run of this spec with as many logged steps or more)")
    ap.add_argument("--out", type=Path, default=None, help="logs, table and plot here instead of [compare] out")
    ap.add_argument("--parallel", type=int, default=None, metavar="N",
                    help="arms at once, each on its own GPU, instead of the spec's parallel")
    ap.add_argument("--mode", choices=list(MODES), default=None,
                    help=f"how every arm runs, instead of the spec's mode (default {DEFAULT_MODE})")
    args = ap.parse_args(argv)
    if args.replace_logs and args.import_logs is None:
        fail(PROG, "--replace-logs goes with --import-logs")
    if args.import_logs is not None and args.rerun:
        fail(PROG, "--import-logs runs no arm: drop --rerun")
    args.report_only |= args.import_logs is not None
    args.spec = resolve_spec(args.spec)
    try:
        spec = load_spec(args.spec)
    except (ValueError, OSError) as e:
        fail(PROG, str(e))
    if args.out is not None:
        spec.out = args.out
    if args.timeout_s is not None:
        if not 0 <= args.timeout_s < float("inf"):
            fail(PROG, f"--timeout-s must be a non-negative number, got {args.timeout_s}")
        spec.timeout_s = args.timeout_s
    if args.parallel is not None:
        if args.parallel < 1:
            fail(PROG, f"--parallel must be >= 1, got {args.parallel}")
        spec.parallel = args.parallel
    if args.mode is not None:
        spec.mode = args.mode
        for arm in spec.arms:
            arm.mode = None
    names = [a.name for a in spec.arms]
    for n in args.only or []:
        if n not in names:
            fail(PROG, f"--only {n!r} is not an arm of {args.spec} ({names})")
    selected = [(i, a) for i, a in enumerate(spec.arms, 1) if args.only is None or a.name in args.only]
    if not args.report_only:
        try:
            check_arm_args(spec, str(args.spec), [a for _, a in selected])
        except ValueError as e:
            fail(PROG, str(e))
    if spec.out.exists() and not spec.out.is_dir():
        fail(PROG, f"out folder {spec.out} is a file")
    if not args.report_only:
        try:
            spec.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            fail(PROG, f"out folder {spec.out}: cannot create it: {e.strerror or e}")
    elif args.import_logs is not None:
        try:
            spec.out.mkdir(parents=True, exist_ok=True)
            for line in import_logs(spec, args.import_logs, args.only, args.replace_logs):
                print(f"compare: {line}")
        except OSError as e:
            fail(PROG, f"out folder {spec.out}: {e.strerror or e}")
        except ValueError as e:
            fail(PROG, str(e))
    elif not spec.out.is_dir():
        fail(PROG, f"out folder {spec.out} does not exist: nothing to report")
    failed = []
    if not args.report_only:
        try:
            failed = run_selected(spec, selected, args.rerun)
        except Refused as e:
            fail(PROG, str(e))
        except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM or SIGHUP: the arms are stopped by now
            signum = getattr(e, "signum", signal.SIGINT)
            print(f"{PROG}: stopped by {signal.Signals(signum).name}; the arms it ran are stopped", file=sys.stderr)
            return 128 + signum
    try:
        print(report(spec), end="")
        print(f"compare: wrote {spec.out / 'compare.md'}, compare.csv, compare.png")
    except RuntimeError as e:  # the baseline has not logged yet (--only another arm, or it failed)
        print(f"compare: no table yet: {e}", file=sys.stderr)
    except ValueError as e:  # an output that cannot be written (a read-only folder, a folder in its place)
        fail(PROG, str(e))
    if failed:
        print(f"compare: arms that failed: {', '.join(failed)} (see their logs in {spec.out})", file=sys.stderr)
    return 1 if failed else 0
