"""Child processes of the signal tests.

A shell runs a background job with SIGINT ignored, and its children inherit that (CI, a
``nohup ... &``): a child that must take Ctrl-C as a user's shell delivers it restores the default
disposition first (``preexec_fn=sigint_default``); Python then installs its KeyboardInterrupt
handler at start-up as usual.
"""

from __future__ import annotations

import signal


def sigint_default() -> None:
    """Run in the child between fork and exec: SIGINT at its default disposition."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
