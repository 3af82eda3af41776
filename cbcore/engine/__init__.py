"""The engine: what decides and executes one step, with no threads (docs/design.md, "The step's data path", "Threads").

`EngineCore` (core.py) owns the cache, the scheduler and the runner and is stepped directly by the manager's loop
thread, by tests and by the profiler; `sizing.py` decides the cache's size and the step budgets.
"""

from .core import EngineCore

__all__ = ["EngineCore"]
