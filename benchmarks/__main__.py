"""``python -m benchmarks``: see ``benchmarks.runner``."""

import os
import sys

from benchmarks.runner import main

code = main()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)  # all is written and the cluster is down; torch's interpreter teardown takes ~1 s more, for nothing
