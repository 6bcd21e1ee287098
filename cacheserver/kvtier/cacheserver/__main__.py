"""``python -m kvtier.cacheserver``: the same as ``kvtier server``."""

from kvtier.cacheserver.cli import main

raise SystemExit(main(prog="python -m kvtier.cacheserver"))
