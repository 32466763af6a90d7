"""Thin stage CLIs: ``python -m stages.<name> --params params.yaml ...``.

Importing the package fixes the OpenMP / MKL team sizes and the CPU code paths of the stage
process before any stage imports numpy, scipy or torch
(:func:`paco.core.numerics.require_fixed_numerics`): a cached stage's bytes must depend neither
on the machine's load nor on its CPU model.
"""

from paco.core.numerics import require_fixed_numerics

require_fixed_numerics()
