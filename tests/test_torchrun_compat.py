"""torchrun command lines for every torch from the floor up: built from the installed parser.

An older torchrun is simulated by the installed one's parser with options taken out: torch
2.11's rejects ``--shutdown-timeout`` (seen on an H100, 2026), older releases spell multi-word
options with underscores only and lack ``--local-addr``. The command lines must parse with such a
parser, and a real launch with them must still work.
"""

import argparse
import copy
import io

import pytest

from course_lib.launch import torchrun
from course_lib.launch.api import launch
from course_lib.launch.placement import LaunchConfigError


def older_parser(removed=(), underscore_only=False) -> argparse.ArgumentParser:
    """The installed torchrun's parser without the options in ``removed`` (either spelling), and
    with only the underscore spelling of multi-word options if ``underscore_only``."""
    parser = copy.deepcopy(torchrun.installed_parser())
    drop = []
    for option, action in list(parser._option_string_actions.items()):
        name = option.replace("_", "-")
        if name in removed or (underscore_only and "-" in option[2:] and option.startswith("--")):
            drop.append((option, action))
    parser._handle_conflict_resolve(None, drop)  # argparse's own way to take option strings out
    return parser


TORCH_2_11 = {"removed": ("--shutdown-timeout",)}
OLDER = {"removed": ("--shutdown-timeout", "--local-addr", "--numa-binding", "--signals-to-handle",
                     "--virtual-local-rank", "--event-log-handler", "--duplicate-stdout-filters",
                     "--duplicate-stderr-filters"), "underscore_only": True}


def all_flag_sets():
    return [torchrun.single_node_flags(2, log_dir="/tmp/x"), torchrun.single_node_flags(2, rdzv="static", port=1234),
            torchrun.multi_node_flags(2, 4, "node01:29400", "job-1", is_host=True, local_addr="10.0.0.1",
                                      log_dir="/tmp/y")]


@pytest.mark.parametrize("older", [TORCH_2_11, OLDER], ids=["torch-2.11", "older"])
def test_command_lines_parse_with_an_older_torchrun(older):
    parser = older_parser(**older)
    accepted = torchrun.accepted_options(parser)
    assert "--shutdown-timeout" not in accepted and "--shutdown_timeout" not in accepted
    for flags in all_flag_sets():
        fitted = torchrun.fit_to_torchrun(flags, accepted)
        args = parser.parse_args([*fitted, "train.py", "--lr=1"])  # exits (SystemExit) on an unknown option
        assert not any(f.startswith(("--shutdown-timeout", "--shutdown_timeout")) for f in fitted)
        assert args.nproc_per_node in ("2", "4") and args.max_restarts == 0 and args.training_script == "train.py"
        assert args.training_script_args == ["--lr=1"]
        if older.get("underscore_only"):
            assert all("-" not in f.partition("=")[0][2:] for f in fitted), fitted
            assert not hasattr(args, "local_addr")  # left out: older torchrun has no --local-addr


def test_the_installed_torchrun_accepts_what_it_is_given():
    # On a torchrun that has every option (2.13) the flags pass unchanged; on an older one the
    # options it lacks are left out (only those the course can do without) and the rest are
    # spelled its way. Either way its own parser takes the result.
    accepted = torchrun.accepted_options()
    for flags in all_flag_sets():
        fitted = torchrun.fit_to_torchrun(flags, accepted)
        missing = {f.split("=")[0] for f in flags} - {o.replace("_", "-") for o in accepted}
        assert missing <= set(torchrun.OPTIONAL), missing
        if not missing and all(f.split("=")[0] in accepted for f in flags):
            assert fitted == flags
        assert len(fitted) == len(flags) - sum(f.split("=")[0] in missing for f in flags)
        torchrun.installed_parser().parse_args([*fitted, "train.py"])


def test_a_missing_option_the_launch_needs_is_refused():
    accepted = torchrun.accepted_options(older_parser(removed=("--rdzv-endpoint",)))
    with pytest.raises(LaunchConfigError, match="the installed torchrun does not accept --rdzv-endpoint"):
        torchrun.fit_to_torchrun(torchrun.single_node_flags(2), accepted)


@pytest.mark.timeout(120)
def test_a_real_launch_with_an_older_torchrun_command_line(tmp_path, monkeypatch):
    """The installed torchrun runs the command line an older one would get (no --shutdown-timeout,
    no --local-addr, underscore spellings): the ranks still meet and finish, and the course's own
    supervision stops them."""
    older = older_parser(**OLDER)
    monkeypatch.setattr(torchrun, "installed_parser", lambda: older)
    script = tmp_path / "sum.py"
    script.write_text("t = torch.tensor([RANK + 1.0])\ndist.all_reduce(t)\nprint(RANK, t.item())\n")
    r = launch(script, nproc=2, device="cpu", init_process_group=True, run_dir=tmp_path / "run", show_ranks="all",
               out=io.StringIO(), err=io.StringIO())
    assert r.ok, r.error
    assert r.stdout == {0: "0 3.0\n", 1: "1 3.0\n"}
    assert "--nproc_per_node=2" in r.command and not any("shutdown" in a or "local_addr" in a for a in r.command)
