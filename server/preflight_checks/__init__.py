"""The individual preflight checks; ``server/preflight.py`` runs them and owns the CLI."""
