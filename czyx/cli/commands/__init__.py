"""CLI subcommands, one module each.

A module here defines ``register(subparsers)`` which adds its subparser and
sets ``func`` (a callable taking the parsed ``argparse.Namespace`` and
returning an exit code). Modules are discovered, so adding a command never
edits a shared file. Heavy imports (store, inference, torch) belong inside
the command function so that ``czyx --help`` stays instant.
"""
