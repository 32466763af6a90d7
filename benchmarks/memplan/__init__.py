"""The parts of the paper preset's memory plan; ``benchmarks/memory_plan.py`` is its command and
describes the columns.

* :mod:`memplan.models`: the real models' embedded configs, their parameter and LoRA counts;
* :mod:`memplan.activations`: saved-activation bytes per token of a block, measured or analytic;
* :mod:`memplan.planner`: the rows (weights, LoRA, activations, totals, fits) and their table.
"""
