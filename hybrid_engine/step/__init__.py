"""The step path: a scheduled step becomes device work (input preparation, forward, sampling,
drafting, the one D2H copy). ``runner.ModelRunner.execute`` is the entry; see docs/design.md."""
