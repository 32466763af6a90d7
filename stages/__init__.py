"""Thin stage CLIs: ``python -m stages.<name> --params params.yaml ...``.

Importing the package fixes the OpenMP / MKL team sizes of the stage process before any stage
imports torch (:data:`paco.core.stage.FIXED_THREAD_ENV`): a cached stage's bytes must not depend
on the machine's load.
"""

import os

from paco.core.stage import FIXED_THREAD_ENV

os.environ.update(FIXED_THREAD_ENV)
