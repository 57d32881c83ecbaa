"""The plan layer: from ``run()``'s arguments to the episodes to play (above the model only).

``_arguments`` checks the per-episode arguments, ``_mixes`` plans a ``MultiMixEnvironment``,
``_layout`` is the folder layout of saved episodes and reads it back for ``resume``,
``_planner.plan_run`` puts them together.
"""
