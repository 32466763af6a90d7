"""``python -m paco.judge.serve``: the judge server's command line (:func:`paco.judge.serve.cli.main`)."""

import sys

from paco.judge.serve.cli import main

if __name__ == "__main__":
    sys.exit(main())
