"""course_lib: the library behind the distributed-training course.

    gpt          the model, its data, checkpoints
    trainer      a run's configuration (TrainConfig), the training loop one process runs (each torchrun
                 worker), its metrics
    parallel     the Strategy interface and the strategies (DDP, ZeRO, FSDP), TP, PP, collectives
    launch       starting ranks: launch, launch_training, the notebook magics, clusters
    analysis     closed-form models: communication cost, memory, scaling laws, strategy guide
    experiments  the measured experiments behind the notebooks
    notebook     what a person sees: smoke mode, plots, widgets, diagrams, the demo
    pram         the PRAM simulator of notebook 6
    exercises    building and grading the exercises
    cli          ``course``: dispatches to the command each package implements
    hardware     hardware profiles, peak FLOP/s, ``course info``
    registry     the facts about the training strategies, torch-free (names, classes, ZeRO stage, ...),
                 and the configuration's torch-free pieces (ConfigError, ParallelConfig: the parallel layout)
    utils        free ports, atomic writes, the process group, where the course is published

ARCHITECTURE.md (top of the repository) shows how they depend on each other. Importing this
package has no side effects. ``%load_ext course_lib`` registers the
``%%torchrun`` and ``%%mpirun`` cell magics and the ``%ranks`` / ``%%ranks`` magics of the
persistent rank pool (see :mod:`course_lib.launch`).
"""

__version__ = "0.1.0"


def load_ipython_extension(ipython):  # pragma: no cover - exercised through a real kernel
    from course_lib.launch import magics  # IPython and the launcher only on %load_ext

    magics.register(ipython)  # %%torchrun, %%mpirun, %ranks and %%ranks
