"""``python -m cake_cute`` is the ``cake-cute`` command."""

import sys

from .tools.cli import main

sys.exit(main())
