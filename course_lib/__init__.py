"""course_lib: the library behind the distributed-training course.

Importing this package has no side effects. ``%load_ext course_lib`` registers the
``%%torchrun`` and ``%%mpirun`` cell magics (see :mod:`course_lib.launch`).
"""

__version__ = "0.1.0"

# Where the course lives on GitHub: the Colab badges, the Colab install cell and the links to
# committed images are built from these two names (course_lib.notebook.smoke). PLACEHOLDER: the real
# organisation/repository is not known yet; change it here, then run
# `python tools/notebooks.py sync` to rewrite the badges and setup cells of the notebooks.
GITHUB_REPO = "course-org/parallel-dl-course"
GITHUB_BRANCH = "main"


def load_ipython_extension(ipython):  # pragma: no cover - exercised through a real kernel
    from course_lib.launch.magics import register

    register(ipython)
