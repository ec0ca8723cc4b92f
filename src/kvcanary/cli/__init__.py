"""The ``kvcanary`` command (`kvcanary.cli.main`): ``demo`` today."""
