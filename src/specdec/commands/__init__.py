"""Subcommands of the ``specdec`` CLI, one module each (discovered by ``specdec.cli``)."""
