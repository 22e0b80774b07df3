"""CLI subcommands; each module exposes ``register(subparsers)``. See :mod:`attnscale.cli`."""
