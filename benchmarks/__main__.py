"""``python -m benchmarks``: see ``benchmarks.runner``."""

from benchmarks.runner import main

raise SystemExit(main())
