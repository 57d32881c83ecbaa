"""Running episodes on a Dask cluster (``pip install 'asyncrunner[dask]'``).

``AsyncRunner(env, agent=..., executor=client)`` takes a ``distributed.Client`` or a scheduler
address directly; ``DaskExecutor`` is for choosing where the event channel listens
(``listen="tcp://HOST:PORT"``) or starting a ``LocalCluster`` (``local_workers=N``).
"""

from __future__ import annotations

from ._pools._dask import DaskExecutor, WorkerLost

__all__ = ["DaskExecutor", "WorkerLost"]
