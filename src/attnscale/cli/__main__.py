"""``python -m attnscale.cli``: the ``attnscale`` command."""

import sys

from attnscale.cli import main

sys.exit(main())
