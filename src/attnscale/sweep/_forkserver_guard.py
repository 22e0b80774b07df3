"""Imported only in the sweep's fork server (``set_forkserver_preload``), for its side effect:
the fork server asks Linux to SIGKILL it when the driver that started it dies, however it dies.

Workers already die with their parent, the fork server (:func:`attnscale.workers.die_with_parent`,
which :mod:`attnscale.sweep.local` calls in each worker); without this guard a SIGKILLed driver
would leave the fork server, and through it every running worker, alive until their trials end.
Nothing else imports this module: importing it in the driver would tie the driver's life to its own
parent.
"""

from attnscale.workers import die_with_parent

die_with_parent()
