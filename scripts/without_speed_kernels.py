"""Run the ``dselectk`` CLI with the speed kernels that changed float rounding turned off.

Issue 21 asks that the redesign keep the quick defaults' records of a78ed56, metric for
metric. Two later speed changes compute the same formulas in another order, so their records
differ from a78ed56's in the last bits (then, through training and the swap search's discrete
moves, more; each was tested equal to the formulas it replaced to float rounding):

- 06a056d, the small-problem kernel (``kernels.dispatch.SMALL_MAX_ELEMENTS``), and the NumPy
  and numba host kernels after it (``DSELECTK_KERNEL``);
- dc4db40, the fused kernel's broadcast combine for small problems
  (``kernels.aten._BROADCAST_MAX_ELEMENTS``).

This script sets ``DSELECTK_KERNEL=aten`` and both limits to 0 (the formulas a78ed56 ran),
then runs the CLI in this process; pass ``--jobs 1`` (worker processes would not inherit the
limits). Usage, beside a checkout of a78ed56 in /tmp/a78::

    PYTHONPATH=/tmp/a78/src python -m dselectk.cli reproduce recovery --out OLD/recovery
    python scripts/without_speed_kernels.py reproduce recovery --out NEW/recovery --jobs 1
    python scripts/compare_records.py OLD/recovery NEW/recovery
"""

from __future__ import annotations

import os
import sys

os.environ["DSELECTK_KERNEL"] = "aten"

import dselectk.kernels.aten as aten
import dselectk.kernels.dispatch as dispatch
from dselectk.cli import main

dispatch.SMALL_MAX_ELEMENTS = 0
aten._BROADCAST_MAX_ELEMENTS = 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
