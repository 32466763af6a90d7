"""Thin stage CLIs: ``python -m stages.<name> --params params.yaml ...``."""
