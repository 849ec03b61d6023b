"""course_lib: the library behind the distributed-training course.

Importing this package has no side effects. ``%load_ext course_lib`` registers the
``%%torchrun`` and ``%%mpirun`` cell magics (see :mod:`course_lib.launch`).
"""

__version__ = "0.1.0"


def load_ipython_extension(ipython):  # pragma: no cover - exercised through a real kernel
    from course_lib.launch.magics import register

    register(ipython)
