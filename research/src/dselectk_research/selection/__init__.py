"""``dselectk reproduce selection``: who selects the right experts, DSelect-k's smooth phase or
the swap search? A pre-registered study on the expert-recovery task: arms DSelect-k,
Top-k, COMET, each with and without the swap search (refit scoring; COMET is not searchable),
and a search-only arm (DSelect-k's gate frozen at init); learning rate tuned per arm and shape
on validation loss, the selected one read once on a test set; paired seeds; data seeds from a
reserved range. The protocol is :data:`study.PROTOCOL`, printed at the top of every report.

``study``: arms, protocol, data, one cell (recovery or Appendix C.1); ``recipe``: flags, run
config, dry run; ``report``.
"""

from dselectk_research.selection.recipe import SelectionConfig, add_arguments, run
from dselectk_research.selection.report import write_report
from dselectk_research.selection.study import ARMS, PROTOCOL

__all__ = ["ARMS", "PROTOCOL", "SelectionConfig", "add_arguments", "run", "write_report"]
