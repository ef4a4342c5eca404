"""``python -m reach_broker``: the same as ``reach``."""

import sys

from .cli.parser import main

sys.exit(main())
