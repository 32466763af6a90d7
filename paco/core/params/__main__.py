"""``python -m paco.core.params [params.yaml] [--out FILE]``: :func:`paco.core.params.cli.main`."""

import sys

from paco.core.params.cli import main

if __name__ == "__main__":
    sys.exit(main())
