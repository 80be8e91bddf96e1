"""A training run, on top of everything else: its config (`eqxzoo.run.config`), run directory
(`eqxzoo.run.rundir`), dry-run plan (`eqxzoo.run.plan`) and loop (`eqxzoo.run.loop`).

This layer alone turns a config into a zoo model (it imports `models`); the trainer, the data
pipeline and the parallel code below it know a model only by its contract
(`eqxzoo.nn.LanguageModel`), which `tests/test_imports.py` checks for every module.
"""
