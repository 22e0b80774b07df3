"""The ``attnscale`` command's entry point.

Importing attnscale imports PyTorch, a few seconds in which a Ctrl-C would otherwise end the
command with a traceback; here it ends with one line and exit status 130, as a Ctrl-C anywhere
later does (:func:`attnscale.cli.main`).  This module imports nothing of its own, so that the
interrupt can be caught while everything else loads.
"""

import sys


def main() -> int:
    try:
        from attnscale.cli import main as command
    except KeyboardInterrupt:
        print("attnscale: interrupted", file=sys.stderr)
        return 130
    return command()
