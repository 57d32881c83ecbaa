"""The ``asyncrunner`` command line (the top layer): ``run``, ``show``, ``score``, ``bench``.

``_common`` holds what the commands share; ``_main.main`` hands each command to its module,
``_main.console`` is the process's entry point.
"""

from ._main import console, main

__all__ = ["console", "main"]
