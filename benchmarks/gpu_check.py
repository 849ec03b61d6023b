"""python benchmarks/gpu_check.py [--dry-run] [--full]   (= course check-gpu; make check-gpu, make test-gpu)

The GPU check of :mod:`course_lib.experiments.gpu_check` on one CUDA GPU: the shakespeare_char
recipe in bf16 against nanoGPT's 1.4697 and in fp16 with loss scaling, NCCL through torchrun and
the collectives benchmark, GPT-2-small memory against the model and its MFU with and without
torch.compile. Appends its Markdown report to benchmarks/RESULTS.md.
"""

import sys

from course_lib.experiments.gpu_check import cli

if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
