"""``python -m kvtier.operator``: the same as ``kvtier operator``."""

import sys

from kvtier.operator.main import run

raise SystemExit(run(sys.argv[1:]))
