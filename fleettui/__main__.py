"""Provides `python -m fleettui`."""

import sys

from fleettui.cli import main

sys.exit(main())
