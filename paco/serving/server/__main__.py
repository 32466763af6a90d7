"""``python -m paco.serving.server``: the judge server's command line (:func:`paco.serving.server.cli.main`)."""

import sys

from paco.serving.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
