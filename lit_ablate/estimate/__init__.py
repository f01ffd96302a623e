"""The analytic model of a run, checked against measurement.

- ``flops``: parameter counts and training FLOPs per token (what modules and callbacks import);
- ``shapes``: the model and training shapes the estimates read;
- ``memory``: bytes per rank at a step's peak, by category, for every strategy;
- ``pipeline``: stages, the pieces a pipeline rank holds and the pipeline's time share;
- ``agreement``: an estimate against a run record's measured categories;
- ``from_config``: all of the above from a resolved fit config;
- ``peaks`` and ``matmul_ceiling``: the denominators of MFU (a device's spec peak, its measured matmul rate).

The ``lit-ablate estimate`` command is ``lit_ablate.commands.estimate``.
"""
