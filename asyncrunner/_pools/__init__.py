"""The pools layer: the kinds of ``WorkerPool`` (``_engine._pool``) the runner picks from.

``_fork`` (local workers forked from this process, on Linux), ``_process`` (fresh interpreters,
``anyio.to_process``), ``_executor`` (a ``concurrent.futures.Executor``), ``_dask`` (a cluster).
"""
