"""Scoring (an application above the runner): ``_scoring.score`` plays the agents and grid2op's
reference agents at once; ``_grid2op`` bridges to grid2op's score classes and statistics."""
