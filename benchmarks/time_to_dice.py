"""Time-to-Dice benchmark: baseline vs monai_tutorial vs fast on the same data, in the same run.

Same as ``monai-fast bench``; every option of that command works here::

    python benchmarks/time_to_dice.py --repeats 2
    python benchmarks/time_to_dice.py --recipes monai_tutorial fast --time-budget 600 --device cuda

Prints a table per repeat and the medians, and writes ``benchmarks/results/time_to_dice_<time>.json``
with every epoch of every run, the machine and the package versions.
"""

import sys

from monai_fast.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
