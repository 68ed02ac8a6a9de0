"""specserve replicas on Ray Serve (`pip install 'specserve[ray]'`): data parallelism with
prefix-affinity routing and failover behind one front door. Ray is imported on first use."""

import importlib
from typing import Any

_EXPORTS = {"build_openai_app": "app", "serve_ray": "app", "start": "app", "stop": "app", "FrontDoor": "frontdoor"}
_EXPORTS |= {"RouterOptions": "frontdoor", "SpecserveReplica": "replica"}
__all__ = ["FrontDoor", "RouterOptions", "SpecserveReplica", "build_openai_app", "serve_ray", "start", "stop"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specserve.ray' has no attribute {name!r}")
    return getattr(importlib.import_module(f"specserve.ray.{_EXPORTS[name]}"), name)
