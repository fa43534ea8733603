"""onestream: a GPU pool for coding agents, one sequence per card."""

__version__ = "0.1.0"
