"""The engine layer: playing a run's requests (above the model, plan and sinks).

``_dispatch.Run`` hands requests to a ``_pool.WorkerPool`` and fans the events out to the sinks;
``_channel`` carries the events back from the workers (and its wire protocol); ``_worker`` is
what runs in a worker (env cache, reset contract, step loop); ``_central`` serves a
``CentralAgent``'s actions to the workers.
"""
