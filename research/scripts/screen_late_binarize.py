"""Issue 23 screen: train soft, binarize late (development seeds only).
Per token, DSelect-k trains best with soft bits (λ = 0, ``research/notes/per_token.md`` §4l–§4m),
but then
the gate is not the paper's exactly sparse gate: the layer's top-k cut picks the experts. Here
the entropy regulariser is 0 for the first ``--delay`` of the steps and then ramps linearly to
``--lambda-end`` by the last step, so the bits are soft while the routing is learned and binary
(exactly sparse, the paper's property) at the end. The rest is the study's settings with the
layer's renormalised top-k cut (``--renormalize true``), as in §4m. One JSON line per seed.
    python scripts/screen_late_binarize.py --router dselect_k_distinct --lambda-end 0.1 \
        --delay 0.5 --seeds 100 101
"""

from __future__ import annotations

import argparse
import dataclasses

import _screen as screen

import dselectk_research.token_moe.model as tm
from dselectk.variants import Ramp


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--router", default="dselect_k", choices=[r for r in tm.ROUTERS if "dselect" in r]
    )
    p.add_argument("--lambda-end", type=float, required=True, help="λ at the last step")
    p.add_argument("--delay", type=float, default=0.5, help="fraction of the steps at λ = 0")
    screen.add_arguments(p)
    a = p.parse_args()
    if not 0.0 <= a.delay < 1.0:
        p.error(f"--delay {a.delay}: expected a fraction in [0, 1)")
    if a.lambda_end < 0:
        p.error(f"--lambda-end {a.lambda_end}: expected a number >= 0")
    ramp = Ramp("entropy_reg", start=0.0, end=a.lambda_end, delay=a.delay, before=0.0)
    variant = dataclasses.replace(tm.ROUTERS[a.router], schedules=(ramp,))
    hp, corpus = screen.settings(p, a)
    hp = {**hp, "entropy_reg": 0.0, "renormalize": True}
    for seed in a.seeds:
        fields = {"router": a.router, "lambda_end": a.lambda_end, "delay": a.delay,
                  "seed": seed, "balance": a.balance, "steps": a.steps}  # fmt: skip
        screen.run(fields, variant, hp, corpus, seed, extra=("train_seconds",))


if __name__ == "__main__":
    main()
