"""``python -m benchmarks``: see ``benchmarks.runner``."""

import os
import sys

from benchmarks.runner import main

code = main()
sys.stdout.flush()
sys.stderr.flush()
# Everything is written and the cluster is shut down by now; the interpreter's own teardown
# with torch loaded takes most of a second more (measured 0.7-1.3 s), for nothing.
os._exit(code)
