"""Sub-commands of the `onestream` console script; each module exposes `register(subparsers)`."""
