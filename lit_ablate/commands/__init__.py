"""The plain ``lit-ablate`` commands (``lit_ablate.command_table`` lists them): ``ablate`` and ``report``,
``estimate``, ``peak``, ``generate`` and ``export``. ``fit``/``validate``/``test`` are ``lit_ablate.fit_cli``."""
