"""``Runner``: a synchronous drop-in for ``grid2op.Runner.Runner``, playing on asyncrunner.

    from asyncrunner.compat import Runner  # instead of: from grid2op.Runner import Runner

Where it differs from grid2op's Runner: see ``asyncrunner.compat._runner`` and the README.
"""

from ._runner import Runner

__all__ = ["Runner"]
