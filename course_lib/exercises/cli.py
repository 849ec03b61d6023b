"""Command lines: ``course exercises build|check|list|sync|publish|new`` and ``course grade``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from course_lib.exercises.build import build_exercise, check_exercise, course_wheel, zip_package_differences
from course_lib.exercises.cell_limit import check_cell_timeout
from course_lib.exercises.colab import setup_cell_problems, sync_setup_cell
from course_lib.exercises.grade import (
    CELL_TIMEOUT_ENV,
    SUBMISSION_LIMIT_S,
    find_autograder,
    grade_many,
    points_text,
)
from course_lib.exercises.gradebook import write_csv, write_feedback
from course_lib.exercises.layout import default_root, discover_releases, select
from course_lib.exercises.publish import new_exercise, publish


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="course exercises",
                                description="Build the graded exercises with otter-grader.")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="run otter assign: exercises/NN_topic (student release) and "
                                      "build/exercises/NN_topic (autograder release)")
    b.add_argument("names", nargs="*", help="exercises to build (NN or NN_topic; default: all)")
    b.add_argument("--root", type=Path, help="folder of instructor sources (default: instructor/ of this clone)")
    b.add_argument("--verify", action="store_true",
                   help="then grade each solution (must score full marks) and blank release (zero)")
    b.add_argument("--jobs", type=int, default=2, help="gradings at once for --verify (default 2)")
    b.add_argument("-v", "--verbose", action="store_true", help="show otter's output")
    c = sub.add_parser("check", help="fail if a student release is stale or was edited by hand")
    c.add_argument("names", nargs="*", help="exercises (NN or NN_topic; default: all)")
    c.add_argument("--root", type=Path, help="folder of instructor sources (default: instructor/ of this clone)")
    ls = sub.add_parser("list", help="list the exercises")
    ls.add_argument("--root", type=Path, help="folder of instructor sources (default: instructor/ of this clone)")
    sy = sub.add_parser("sync", help="rewrite each source's setup cell from course_lib.utils.GITHUB_REPO")
    sy.add_argument("names", nargs="*", help="exercises (NN or NN_topic; default: all)")
    sy.add_argument("--root", type=Path, help="folder of instructor sources (default: instructor/ of this clone)")
    pb = sub.add_parser("publish", help="write what students get (student notebooks, public tests, "
                                         "data, README) into OUT: no solution, no hidden test")
    pb.add_argument("out", type=Path, help="a new (or empty) folder: the students' repository")
    pb.add_argument("names", nargs="*", help="exercises (NN or NN_topic; default: all)")
    pb.add_argument("--root", type=Path, help="folder of instructor sources (default: instructor/ of this clone)")
    pb.add_argument("--data", type=Path, help="a data folder to include (default: data/ next to the sources' folder)")
    nw = sub.add_parser("new", help="a new exercise source NN_topic from a template")
    nw.add_argument("name", help="NN_topic: two digits, then the topic in lowercase (e.g. 07_mean)")
    nw.add_argument("--root", type=Path, help="folder of instructor sources (default: instructor/ of this clone)")
    args = p.parse_args(argv)

    if args.cmd == "new":
        try:
            path = new_exercise(args.name, args.root if args.root is not None else default_root())
        except (ValueError, FileExistsError, FileNotFoundError) as e:
            print(f"course exercises: {e}", file=sys.stderr)
            return 2
        print(f"wrote {path}; edit it, then `course exercises build {args.name}`")
        return 0

    names = getattr(args, "names", [])
    try:
        exercises = select(names, args.root)
    except FileNotFoundError as e:  # a public clone: check and list can still look at the releases
        wanted = {n.zfill(2) if n.isdigit() else n for n in names}
        exercises = [ex for ex in discover_releases() if not wanted or wanted & {ex.name, ex.name[:2]}]
        if args.cmd not in ("check", "list") or args.root is not None or not exercises:
            print(f"course exercises: {e}", file=sys.stderr)
            return 2
        print("course exercises: no instructor sources here (they are private): checking the student "
              "releases against their manifests only", file=sys.stderr)
    except ValueError as e:
        print(f"course exercises: {e}", file=sys.stderr)
        return 2
    if args.cmd == "list":
        for ex in exercises:
            state = "up to date" if not check_exercise(ex) else "needs build"
            print(f"{ex.name:<24} {state}")
        return 0
    if args.cmd == "sync":
        for ex in exercises:
            if sync_setup_cell(ex):
                print(f"rewrote the setup cell of {ex.source}; now run `course exercises build {ex.name}`")
        return 0
    if args.cmd == "publish":
        data = args.data if args.data is not None else exercises[0].dir.parent.parent / "data" if exercises else None
        try:
            written = publish(exercises, args.out, data)
        except (ValueError, FileExistsError) as e:
            print(f"course exercises: {e}", file=sys.stderr)
            return 1
        print(f"wrote {len(written)} files of {len(exercises)} exercises into {args.out}")
        return 0
    if args.cmd == "check":
        stale = {ex.name: check_exercise(ex) + (setup_cell_problems(ex) if ex.source.is_file() else []) for ex in exercises}
        problems = [msg for msgs in stale.values() for msg in msgs]
        for msg in problems:
            print(msg, file=sys.stderr)
        for ex in exercises:  # a note, not a failure: local grading uses the installed course_lib
            if ex.autograder_zip.is_file() and (differ := zip_package_differences(ex.autograder_zip)):
                print(f"note: {ex.autograder_zip} bundles an older course_lib ({len(differ)} modules differ, e.g. "
                      f"{differ[0]}); rebuild it (`course exercises build {ex.name}`) before uploading it to "
                      "Gradescope", file=sys.stderr)
        print(f"{sum(not m for m in stale.values())}/{len(exercises)} exercises up to date")
        return 1 if problems else 0

    todo = exercises
    for _ in range(2):  # (a second pass, when the first rewrote a release the wheel carries)
        with tempfile.TemporaryDirectory(prefix="course_wheel_") as tmp:
            wheel = course_wheel(Path(tmp))  # once for all the autograder zips
            for ex in tqdm(todo, desc="otter assign", unit="exercise", disable=len(todo) < 2):
                try:
                    build_exercise(ex, quiet=not args.verbose, wheel=wheel)
                except Exception as e:  # noqa: BLE001 - otter's errors vary; report which exercise failed
                    print(f"course exercises: building {ex.name} failed: {e}", file=sys.stderr)
                    return 1
                tqdm.write(f"built {ex.release} (student) and {ex.build} (autograder)")
        # The wheel carries the releases' public tests (course_lib/_course): a release that this
        # build rewrote is newer than the wheel the zips got, so those zips are built once more.
        todo = [ex for ex in exercises if zip_package_differences(ex.autograder_zip)]
        if not todo:
            break
    if not args.verify:
        return 0
    subs = [ex.solution_notebook for ex in exercises] + [ex.student_notebook for ex in exercises]
    zips = [ex.autograder_zip for ex in exercises] * 2
    reports = grade_many(subs, zips, jobs=args.jobs, progress=True)
    bad = 0
    for i, r in enumerate(reports):
        want_full = i < len(exercises)
        ok = (r.total == r.possible > 0) if want_full else r.total == 0
        bad += not ok
        kind = "solution" if want_full else "blank release"
        print(f"{'ok ' if ok else 'BAD'} {kind:<13} {Path(r.submission).name:<28} "
              f"{points_text(r.total)} / {points_text(r.possible)}  ({r.seconds:.1f} s)")
    return 1 if bad else 0


def _writable(flag: str, folder: Path, target: Path, folder_wanted: bool) -> None:
    """ValueError unless ``target`` can be written (a file, or a folder with ``folder_wanted``),
    checked before a batch that may take hours is graded."""
    if target.exists() and target.is_dir() != folder_wanted:
        raise ValueError(f"{flag} {target} is {'a file' if folder_wanted else 'a folder'}; give "
                         f"{'a folder' if folder_wanted else 'a file name'}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag}: cannot make the folder {folder} ({e.strerror or e})") from None
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{flag}: the folder {folder} is not writable")


def grade_cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="course grade",
        description="Grade exercise notebooks locally (otter, no Docker, no network): the score of "
                    "each question, then TOTAL: x / y.")
    p.add_argument("submissions", nargs="+", type=Path, help="submitted .ipynb notebooks")
    p.add_argument("--autograder", type=Path,
                   help="autograder zip (default: found from the notebook's assignment name in "
                        "build/exercises/NN_topic/, made by `make exercises`)")
    p.add_argument("--root", type=Path, help="folder of instructor sources (default: instructor/ of this clone)")
    p.add_argument("--jobs", type=int, default=1, help="notebooks graded at once")
    p.add_argument("--cell-timeout", type=float,
                   help=f"seconds any cell may run (default from the exercise; env {CELL_TIMEOUT_ENV})")
    p.add_argument("--time-limit", type=float, default=SUBMISSION_LIMIT_S,
                   help=f"seconds one grading of a submission may take; when a cell runs past it, the "
                        f"submission is graded once more without that cell, and a second stop scores "
                        f"zero (default {SUBMISSION_LIMIT_S:g})")
    p.add_argument("--csv", type=Path, help="write the gradebook: one row per student and question, plus TOTAL")
    p.add_argument("--feedback", type=Path,
                   help="write one student-safe report per submission into this folder "
                        "(scores and public test messages, no hidden-test source)")
    p.add_argument("--seed", type=int, help="the seed hidden tests draw their inputs from, for every "
                   "submission (default: each its own, from its bytes; the report and the CSV record it)")
    p.add_argument("--json", action="store_true", help="print the reports as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no failure messages, scores only")
    args = p.parse_args(argv)

    for s in args.submissions:
        if not s.is_file():
            why = "is a folder: give its notebooks (FOLDER/*.ipynb)" if s.is_dir() else "does not exist"
            print(f"course grade: {s} {why}", file=sys.stderr)
            return 2
    if args.csv or args.feedback:
        # the gradebook's student and the feedback file's name are the file's name without .ipynb
        # (GradeReport.student, of the resolved path): two submissions with one name would overwrite
        # each other's feedback (also where they differ in case only, on a case-insensitive disk)
        # and leave gradebook rows that no one can tell apart
        by_name: dict[str, list[Path]] = {}
        for s in args.submissions:
            by_name.setdefault(s.resolve().stem.casefold(), []).append(s)
        if clash := next((paths for paths in by_name.values() if len(paths) > 1), None):
            print(f"course grade: {' and '.join(map(str, clash))} would have one student name, "
                  f"{clash[0].resolve().stem!r}, in the gradebook and feedback; give each submission "
                  "a file name of its own (e.g. the student's)", file=sys.stderr)
            return 2
    if args.autograder is not None and not args.autograder.is_file():
        print(f"course grade: autograder zip {args.autograder} does not exist", file=sys.stderr)
        return 2
    if not args.time_limit > 0:
        print("course grade: --time-limit must be > 0 seconds", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print("course grade: --jobs must be >= 1", file=sys.stderr)
        return 2
    # each cell's limit is signal.alarm(int(seconds)) in the kernel: nan and inf fail that
    # conversion (every submission would score zero), and past a C int the alarm raises in each
    # cell's hook, which leaves every cell unbounded; the variable set by hand is checked the same way
    flag, value = (("--cell-timeout", args.cell_timeout) if args.cell_timeout is not None
                   else (CELL_TIMEOUT_ENV, os.environ.get(CELL_TIMEOUT_ENV) or None))
    if value is not None:
        try:
            check_cell_timeout(value, flag)
        except ValueError as e:
            print(f"course grade: {e}", file=sys.stderr)
            return 2
    try:
        zips = [args.autograder or find_autograder(s, args.root) for s in args.submissions]
        if args.csv:
            _writable("--csv", args.csv.parent, args.csv, folder_wanted=False)
        if args.feedback:
            _writable("--feedback", args.feedback, args.feedback, folder_wanted=True)
    except (ValueError, FileNotFoundError) as e:
        print(f"course grade: {e}", file=sys.stderr)
        return 2

    def save(report, done):  # as each submission finishes: a crash or Ctrl-C later keeps these
        if args.feedback:
            write_feedback([report], args.feedback)
        if args.csv:
            write_csv(done, args.csv)

    # the workers' environment only: this process's (a notebook's, a test's) stays as it is
    reports = grade_many(args.submissions, zips, args.root, jobs=args.jobs, time_limit=args.time_limit,
                         seed=args.seed, on_report=save, progress=len(args.submissions) > 1, cell_timeout=value)
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        print("\n\n".join(r.format(verbose=not args.quiet) for r in reports))
    return 1 if any(r.error for r in reports) else 0
