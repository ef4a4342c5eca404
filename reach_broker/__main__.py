"""``python -m reach_broker``: the same as ``reach``."""

import sys

from reach_broker.cli.parser import main

sys.exit(main())
