"""``python -m bench HARNESS ...`` (from the repository root): see bench/cli.py."""

import sys

from bench.cli import main

sys.exit(main(sys.argv[1:]))
