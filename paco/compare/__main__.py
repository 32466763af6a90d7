"""``python -m paco.compare``: :func:`paco.compare.cli.main`."""
from paco.compare.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
