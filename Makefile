# The two README commands: `make demo` and `make test`. Each sets up .venv on a fresh clone.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
NPROC   ?= auto
# Notebooks run with the environment's commands on PATH (a cell's `!course info`, torchrun): a kernel
# that .venv/bin/jupyter starts does not put .venv/bin on PATH by itself
ON_PATH := PATH="$(CURDIR)/$(VENV)/bin:$$PATH"
export PIP_DISABLE_PIP_VERSION_CHECK=1

.PHONY: demo lab test test-fast install bytecode images images-check notebooks-clear exercises bench browser-deps slurm-deps mpi-deps slurm-local check-gpu test-gpu book clean

$(VPY):
	$(PY) -m venv $(VENV)

# torch first, pinned to the local CPU wheel, and only when it is not importable: a plain
# range would let pip resolve the newest build with several GB of CUDA packages.
$(STAMP): pyproject.toml | $(VPY)
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[dev]'
	@# jsonschema imports rfc3987-syntax (pulled in by jupyter-events) eagerly, which builds ~35
	@# Earley parsers: 1.5 s on every import of nbformat (each kernel, each grading worker, each
	@# notebook run; python-jsonschema/jsonschema#1428). It skips that import when the regex-based
	@# rfc3987 is installed: a development-environment speed-up only (rfc3987 is GPL; course_lib
	@# neither depends on it nor ships it).
	$(VPY) -m pip install -q rfc3987==1.3.8
	touch $(STAMP)

install: $(STAMP)

# course_lib's bytecode, compiled once per run. Python writes it on first import, except where
# PYTHONDONTWRITEBYTECODE is set (this project's sandboxes and CI set it): then every process of a
# run (each kernel, grading worker, torchrun worker and rank) compiles the modules it imports again,
# about 0.15 s for the trainer's, 4 % of tests/test_launch.py's CPU time. A stale file is harmless:
# Python checks each one against its source and compiles a changed module in memory.
bytecode: $(STAMP)
	$(VPY) -m compileall -q course_lib

# Debian Chromium for the browser test (never `playwright install`: no downloads here).
browser-deps:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	  else echo "chromium missing: sudo apt-get install chromium chromium-driver (browser tests will be skipped)"; fi; }

# Debian's SLURM and munge for the real-SLURM test (tests/test_slurm.py) and `make slurm-local`.
slurm-deps:
	@PATH="$$PATH:/usr/sbin:/sbin"; command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null; \
	  else echo "slurm-wlm/munge missing: sudo apt-get install slurm-wlm munge (the SLURM test will be skipped)"; fi; }

# Debian's Open MPI for the Open MPI launch tests (tests/test_mpi_launch.py), next to the PyPI
# mpich wheel: GPU machines and clusters often have Open MPI, and mpirun() must pick the mpiexec
# that matches the library mpi4py loads (MPI4PY_LIBMPI), also as root.
mpi-deps:
	@command -v ompi_info >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin >/dev/null; \
	  else echo "openmpi-bin missing: sudo apt-get install openmpi-bin (the Open MPI tests will be skipped)"; fi; }

# A 2-node SLURM cluster on this machine (as root): try `course submit --scheduler slurm` here.
slurm-local: $(STAMP) slurm-deps
	$(VPY) -m course_lib.launch.slurm_local --dir runs/slurm-local

demo: $(STAMP) bytecode
	$(VENV)/bin/course data prepare shakespeare_char
	$(VPY) -m course_lib.notebook.demo --nproc=$(NPROC) --out_dir=runs/demo

# JupyterLab on the lessons (README: "Then open the course")
lab: $(STAMP)
	$(ON_PATH) $(VENV)/bin/jupyter lab notebooks/

test: $(STAMP) bytecode browser-deps slurm-deps mpi-deps
	$(VPY) -m pytest -q --durations=15

test-fast: $(STAMP) bytecode
	$(VPY) -m pytest -q -m "not slow and not browser"

# Mermaid sources -> SVG + PNG with mermaid-cli and Debian Chromium (offline). mermaid-cli goes
# into .tools/mermaid (gitignored) without puppeteer's own Chrome: course_lib.notebook.diagrams_build
# points it at the system Chromium.
MMDC_VERSION := 11.17.0
MMDC_STAMP   := .tools/mermaid/.installed-$(MMDC_VERSION)
$(MMDC_STAMP):
	PUPPETEER_SKIP_DOWNLOAD=1 npm install --prefix .tools/mermaid --no-audit --no-fund --save-exact \
	  @mermaid-js/mermaid-cli@$(MMDC_VERSION)
	touch $@

images: $(STAMP) browser-deps $(MMDC_STAMP)
	$(VENV)/bin/course images build

images-check: $(STAMP)
	$(VENV)/bin/course images check

# Clear outputs, execution counts and widget state from every notebook (before committing).
notebooks-clear: $(STAMP)
	$(VPY) tools/notebooks.py clear

# Student releases into exercises/ (commit them) and autograder releases into build/exercises/
# (gitignored: solutions and hidden tests), from the sources in instructor/. What students get:
# `course exercises publish OUT` (exercises/README.md).
exercises: $(STAMP)
	$(VENV)/bin/course exercises build

# The course website in build/book/html (README, "The course website"). BOOK_ARGS=--smoke: shrunk
# runs; BOOK_ARGS=--force: re-execute every notebook. Executed notebooks are cached in build/book/executed.
BOOK_ARGS ?=
book: $(STAMP)
	$(VENV)/bin/course data prepare shakespeare_char
	$(ON_PATH) $(VPY) -m course_lib.notebook.book $(BOOK_ARGS)

bench: $(STAMP)
	$(VPY) benchmarks/train_throughput.py

# On a machine with one CUDA GPU (< 12 min): appends its report to benchmarks/RESULTS.md.
check-gpu: $(STAMP)
	$(VPY) benchmarks/gpu_check.py

# check-gpu plus the tests marked gpu and every lesson in full mode, each timed (~35 min).
test-gpu: $(STAMP)
	$(VENV)/bin/course data prepare shakespeare_char
	$(ON_PATH) $(VPY) benchmarks/gpu_check.py --full

clean:
	rm -rf runs/ .pytest_cache build *.egg-info
