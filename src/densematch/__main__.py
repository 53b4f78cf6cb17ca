"""``python -m densematch``: the densematch command (also under torchrun, sharded)."""

import sys

from .app.cli import main

sys.exit(main())
