"""One module per ``exo-tui`` subcommand; see :mod:`exo_tui.cli`."""
