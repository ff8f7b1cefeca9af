"""``dselectk reproduce token-moe``: per-token routing in a small character-level transformer.

A byte-level causal transformer (:class:`~dselectk_research.char_lm.CharMoETransformer`: 2 layers,
d_model 64, every feed-forward layer a :class:`~dselectk.layers.SparseMoEFeedForward` of 8
experts, k = 2) trained on the Python standard library's own source (the first ~1.5 MB of its
``*.py`` files in sorted order, tests and site-packages left out; the last 10 % of the stream is
the validation part; the file list's hash is in every record; :mod:`dselectk_research.data.text`),
with
per-token DSelect-k against Top-k routing at equal k and n (:data:`ROUTERS`), a few seeds each
(paired: seed s gives both routers the same training windows, in the same order). Reported:
validation bits per byte (= per character for ASCII source), load per expert, experts per
token, the fraction of tokens whose DSelect-k bits are binary, time per step. ``model``:
routers, one run; ``recipe``: flags, run config, one cell per router; ``report``.
"""

from dselectk_research.token_moe.model import DEFAULT_ROUTERS, ROUTERS, build_model
from dselectk_research.token_moe.recipe import DEFAULTS, TokenMoEConfig, add_arguments, run
from dselectk_research.token_moe.report import print_table, write_report

__all__ = ["DEFAULTS", "DEFAULT_ROUTERS", "ROUTERS", "TokenMoEConfig", "add_arguments"]
__all__ += ["build_model", "print_table", "run", "write_report"]
