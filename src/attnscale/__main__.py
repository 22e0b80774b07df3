"""``python -m attnscale``: the ``attnscale`` command."""

import sys

from attnscale.cli import main

sys.exit(main())
