"""The ``asyncrunner`` command line (the top layer): ``run``, ``show``, ``score``, ``bench``.

``_common`` holds what the commands share; ``_main.main`` hands each command to its module.
"""

from ._main import main

__all__ = ["main"]
