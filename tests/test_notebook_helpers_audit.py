"""What the notebook helpers show a student: figures labelled in the unit of the data they draw,
and the source of a class the student defined in a notebook cell.

    python -m pytest tests/test_notebook_helpers_audit.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import matplotlib
import pytest

matplotlib.use("Agg")

from course_lib.hardware import MB, MiB  # noqa: E402
from course_lib.notebook.layout_plots import plot_layouts  # noqa: E402
from course_lib.notebook.precision_plots import plot_state_bytes  # noqa: E402


def _layout_run(path, ranks):
    path.mkdir()
    (path / "metrics.csv").write_text("iter,train_loss,val_loss,step_ms\n0,4.1,4.2,50\n1,4.0,,52\n")
    (path / "run.json").write_text(json.dumps({"world_size": len(ranks)}))
    (path / "ranks.json").write_text(json.dumps({"ranks": ranks}))
    return path


@pytest.mark.timeout(60)
def test_layout_figure_says_the_unit_its_bars_are_in(tmp_path):
    # the table divided bytes by 2**20 (MiB) and the axes said MB, the course's 1e6 (hardware.MB)
    run = _layout_run(tmp_path / "tp2", [{"model_state_bytes": 3 * MB, "peak_activation_bytes": 5 * MB,
                                          "sent_bytes_tp": 2 * MB}] * 2)
    fig = plot_layouts({"tp2": run})
    _, ax_mem, ax_bytes = fig.axes[:3]
    heights = sorted(p.get_height() for p in ax_mem.patches)
    assert heights == pytest.approx([3.0, 5.0])  # the data is in MB ...
    assert ax_mem.get_ylabel().startswith("MB ") and ax_bytes.get_ylabel().startswith("MB ")  # ... as the labels say


@pytest.mark.timeout(60)
def test_state_bytes_label_follows_the_unit():
    bars = {"fp32": {"params": 4 * MiB, "grads": 4 * MiB, "optimizer": 8 * MiB}}
    assert plot_state_bytes(bars).axes[0].get_ylabel() == "MB"  # default unit: 1e6 bytes
    fig = plot_state_bytes(bars, unit=MiB)
    assert fig.axes[0].get_ylabel() == "MiB"
    assert sum(p.get_height() for p in fig.axes[0].patches) == pytest.approx(16.0)
    assert plot_state_bytes(bars, unit=MB * 1000).axes[0].get_ylabel() == "GB"


# A notebook's classes live in IPython's __main__, which has no file: run cells in a real shell
_CELLS = [
    "class Bucket:\n    '''A student's class.'''\n\n    def size(self):\n        return 4\n",
    "from dataclasses import dataclass\n\n\n@dataclass\nclass Shard:\n    rank: int = 0\n\n"
    "    def owner(self):\n        return self.rank\n",
    "def helper(x):\n    return x + 1\n",
    "from course_lib.notebook.source import show_source",
    "show_source(Bucket)",
    "show_source(Shard)",
    "show_source(helper)",
]


@pytest.mark.timeout(120)
def test_show_source_of_a_class_defined_in_a_notebook():
    script = textwrap.dedent(f"""
        import sys
        from IPython.core.interactiveshell import InteractiveShell
        shell = InteractiveShell.instance()
        for cell in {_CELLS!r}:
            result = shell.run_cell(cell)
            if not result.success:
                print("FAILED:", cell.splitlines()[0], repr(result.error_in_exec), file=sys.stderr)
                sys.exit(1)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "class Bucket:" in out and "return 4" in out
    assert "@dataclass\nclass Shard:" in out and "return self.rank" in out  # the decorator too
    assert "def helper(x):" in out
