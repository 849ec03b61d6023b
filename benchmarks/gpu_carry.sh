#!/usr/bin/env bash
# bash benchmarks/gpu_carry.sh NANOGPT   (makes what benchmarks/gpu_session.sh carries to a GPU machine)
#
# A lent GPU machine reaches no package index and no GitHub, so a session carries two ignored folders:
#   .whl/              wheels for the machine's Python 3.12 of the packages its image lacks (the notebook
#                      stack, ipyparallel, mermaid-py, the MPICH wheel); its image has torch, lightning,
#                      transformers, tiktoken, pytest and pytest-xdist. Downloaded here with --no-deps, so
#                      the list below names every package that is missing there, dependencies included;
#   .upstream/nanoGPT  the files of NANOGPT, a clone (or bare git directory) of github.com/karpathy/nanoGPT;
#                      RESULTS.md's runs used its commit 3adf61e (bench.py, model.py and train.py as there).
# Then: device run with carry [".whl", ".upstream"] and the command `bash benchmarks/gpu_session.sh $OUT`.
set -euo pipefail
NANOGPT=${1:?give a clone or bare git directory of karpathy/nanoGPT}
PY=${PYTHON:-python3}
WHEELS="asttokens comm debugpy decorator executing fastjsonschema ipykernel ipyparallel ipython
  ipython_pygments_lexers ipywidgets jedi jsonschema jsonschema_specifications jupyter_client jupyter_core
  jupyterlab_widgets matplotlib_inline mermaid_py mpich nbclient nbformat nest_asyncio2 parso pexpect
  platformdirs prompt_toolkit ptyprocess pure_eval pyzmq referencing rpds_py stack_data tornado traitlets
  tzdata wcwidth widgetsnbextension"

mkdir -p .whl
for name in $WHEELS; do
  ls .whl/"${name}"-[0-9]*.whl >/dev/null 2>&1 && continue  # one version of each: pip refuses two
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "$name"
done

rm -rf .upstream/nanoGPT && mkdir -p .upstream/nanoGPT
if git --git-dir="$NANOGPT" rev-parse --is-bare-repository 2>/dev/null | grep -q true; then
  git --git-dir="$NANOGPT" archive HEAD | tar -x -C .upstream/nanoGPT
else
  git -C "$NANOGPT" archive HEAD | tar -x -C .upstream/nanoGPT
fi
echo "carry: $(ls .whl | wc -l) wheels in .whl, nanoGPT $(git --git-dir="$NANOGPT" rev-parse --short HEAD 2>/dev/null \
  || git -C "$NANOGPT" rev-parse --short HEAD) in .upstream/nanoGPT ($(du -sh .whl .upstream | cut -f1 | tr '\n' ' '))"
