"""python benchmarks/strategies.py --repeats 5 --ranks 1,2

Every training strategy (ours and PyTorch's) x ranks on the Shakespeare CPU recipe: repeated
runs in fresh processes, medians, speedup and efficiency over one process, memory per rank.
The experiment lives in course_lib.experiments.strategy_comparison (notebook 8 runs it from an
installed package); this script is its command line. ``--help`` lists the options.
"""

import sys

from course_lib.experiments.strategy_comparison import main

if __name__ == "__main__":
    sys.exit(main())
