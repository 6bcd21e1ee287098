"""``python -m kvtier.bench HARNESS ...``: the same as ``kvtier bench``; see cli.py."""

import sys

from kvtier.bench.cli import main

sys.exit(main(sys.argv[1:]))
