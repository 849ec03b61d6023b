"""Progress bars that leave their final line in a saved notebook.

    from course_lib.trainer.progress import progress_bar
    bar = progress_bar(total=2000, desc="shakespeare-char")   # tqdm's arguments
    ...; bar.update(1); ...; bar.close()

In a terminal this is tqdm's text bar. In a Jupyter kernel tqdm draws an ipywidgets bar, and the
output it leaves holds only a reference to that widget and the bar's text *at the moment it was
shown*, "0%|          | 0/2000": so a reopened notebook, GitHub's viewer or a static website show a
finished run as not started. Here the bar is shown with a display id, and ``close()`` replaces
that output's ``text/plain`` with the finished line (what ``str(bar)`` prints), keeping the
widget for the live session.
"""

from __future__ import annotations

import functools
import sys
import warnings

from tqdm import TqdmExperimentalWarning


@functools.cache
def _notebook_bar():
    """The notebook bar class (built on first use: tqdm.notebook imports ipywidgets)."""
    # ipywidgets (through tqdm.notebook) only in a notebook: workers and terminals never load it
    from IPython.display import display
    from tqdm.notebook import tqdm as tqdm_notebook

    class NotebookBar(tqdm_notebook):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, display=False, **kwargs)
            self.handle = None if self.disable else display(self._bundle(), raw=True, display_id=True)
            self.displayed = True

        def _bundle(self) -> dict:
            bundle = dict(self.container._repr_mimebundle_())
            bundle["text/plain"] = str(self)  # the bar as tqdm prints it in a terminal
            return bundle

        def close(self):
            closed = self.disable
            super().close()
            if not closed and self.handle is not None:
                self.handle.update(self._bundle(), raw=True)

    return NotebookBar


def in_notebook() -> bool:
    """True in a Jupyter kernel that tqdm draws widget bars in (tqdm.autonotebook's own test)."""
    if "ipykernel.zmqshell" not in sys.modules:  # a terminal or a worker: skip importing ipywidgets
        return False
    # only now: tqdm.notebook imports ipywidgets
    from tqdm import autonotebook, notebook

    return autonotebook.tqdm is notebook.tqdm


def progress_bar(*args, **kwargs):
    """A tqdm bar (same arguments); in a notebook, one whose saved output is its final line."""
    with warnings.catch_warnings():  # tqdm.autonotebook warns that it picked the notebook bar
        warnings.simplefilter("ignore", TqdmExperimentalWarning)
        if kwargs.get("disable") or kwargs.get("file") not in (None, sys.stdout, sys.stderr) or not in_notebook():
            # tqdm.auto picks its bar when imported: only here, outside a notebook
            from tqdm.auto import tqdm

            return tqdm(*args, **kwargs)
        return _notebook_bar()(*args, **kwargs)
