"""`cbcore.manager`: the import path of `ContinuousBatchingManager`, kept for code written against it
(`from cbcore.manager import ContinuousBatchingManager`). The manager and its parts live in `cbcore/serving/`."""

from .serving.generation_loop import BackgroundThreadStatus
from .serving.manager import ContinuousBatchingManager

__all__ = ["BackgroundThreadStatus", "ContinuousBatchingManager"]
