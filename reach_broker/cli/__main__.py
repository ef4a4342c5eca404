"""``python -m reach_broker.cli``: the same as ``reach``."""

import sys

from .parser import main

sys.exit(main())
