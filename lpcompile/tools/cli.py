"""The ``lowprec`` command line: ``dump`` (what the backend did to each graph) and
``report`` (a training run's telemetry as plots)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

DEFAULT_DUMP_DIR = "lowprec_dump"


def _dump(args: argparse.Namespace) -> int:
    import os
    import runpy
    import tempfile

    from lpcompile.tools import dump

    root = Path(args.output or os.environ.get(dump.ENV) or DEFAULT_DUMP_DIR)
    if args.script is None:
        if not args.summary:
            print("lowprec dump: give a SCRIPT to run, or --summary for an existing dump", file=sys.stderr)
            return 2
        if dump.load_manifests(root):  # DIR is a run folder
            print(dump.summary(root), end="")
            return 0
        found = dump.runs(root)
        if not found:
            print(f"lowprec dump: no lowprec dump in {root}", file=sys.stderr)
            return 2
        print(f"{found[-1]}  (the newest of {len(found)} run(s) in {root})")
        print(dump.summary(found[-1]), end="")
        return 0
    script = Path(args.script)
    if not script.is_file():
        print(f"lowprec dump: no script {script}", file=sys.stderr)
        return 2
    try:  # before the script runs: a dump that cannot be written is an error, not "0 graph(s)"
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as error:
        print(f"lowprec dump: cannot write the dump folder {root}: {error}", file=sys.stderr)
        return 2
    saved = sys.argv, list(sys.path), os.environ.get(dump.ENV)
    os.environ[dump.ENV] = str(root)
    run = dump.start_session()
    sys.argv = [str(script), *args.args]
    sys.path.insert(0, str(script.resolve().parent))
    code = 0
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if done.code is not None and not isinstance(done.code, int):  # sys.exit("message")
            print(done.code, file=sys.stderr)
    finally:
        dump.flush()
        sys.argv, sys.path[:] = saved[0], saved[1]
        if saved[2] is None:
            os.environ.pop(dump.ENV, None)
        else:
            os.environ[dump.ENV] = saved[2]
    graphs = len(dump.load_manifests(run))
    if graphs:
        print(f"lowprec dump: {graphs} graph(s) in {run}; open {run / 'index.html'}")
    else:
        print(f"lowprec dump: 0 graph(s); nothing written to {root}")
    if args.summary and graphs:
        print(dump.summary(run), end="")
    return code


def _report(args: argparse.Namespace) -> int:
    from lpcompile.tools.report import write_report

    try:
        page = write_report(args.dir, args.output)
    except FileNotFoundError as error:
        print(f"lowprec report: {error}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as error:
        if not (error.name or "").startswith("matplotlib"):
            raise
        print("lowprec report: plotting needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    print(f"lowprec report: {page} (and {page.with_suffix('.md').name}, PNG plots beside it)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lowprec", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    dump = commands.add_parser(
        "dump",
        help="run a script with LOWPREC_DUMP set; show a dump's summary",
        description="Run SCRIPT (with its ARGS) with LOWPREC_DUMP=DIR: every graph the lowprec backend "
        "compiles is written to DIR/<run>/<model>_<n>/, where <run> (<start>-<host>-<pid>) is this run's "
        "own folder, with <run>/index.html, and DIR/index.html lists the runs; earlier runs stay. With "
        "--summary, print per graph the lowprec nodes by kind and layer, kernels and stages: of this run, "
        "or, when no SCRIPT is given, of DIR's newest run (or of DIR itself, a run folder).",
    )
    dump.add_argument(
        "-o", "--output", metavar="DIR", help=f"dump folder (default $LOWPREC_DUMP, else {DEFAULT_DUMP_DIR})"
    )
    dump.add_argument("--summary", action="store_true", help="print a table per graph")
    dump.add_argument("script", nargs="?", metavar="SCRIPT.py")
    dump.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS")
    dump.set_defaults(func=_dump)
    report = commands.add_parser(
        "report",
        help="plot the telemetry a training run recorded",
        description="Turn the telemetry JSON files under DIR (DIR/telemetry/*.json, written by training runs "
        "under LOWPREC_DUMP=DIR) into PNG plots and report.html / report.md.",
    )
    report.add_argument("dir", metavar="DIR")
    report.add_argument("-o", "--output", metavar="OUT", help="output folder (default DIR/report)")
    report.set_defaults(func=_report)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
