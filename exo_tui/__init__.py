"""exo-tui: a terminal cluster manager that runs one LLM across the computers you own."""

__version__ = "0.1.0"
