"""specserve replicas on Ray Serve (`pip install 'specserve[ray]'`): data parallelism with
prefix-affinity routing and failover behind one OpenAI-compatible front door.

    from ray import serve
    from specserve.ray import build_openai_app
    serve.run(build_openai_app({"model": "smollm2-135m-instruct"}, num_replicas=2))

Importing this package imports Ray; nothing else in specserve does.
"""
from specserve.ray.app import build_openai_app, serve_ray, start, stop
from specserve.ray.frontdoor import FrontDoor, RouterOptions
from specserve.ray.replica import SpecserveReplica

__all__ = ["FrontDoor", "RouterOptions", "SpecserveReplica", "build_openai_app", "serve_ray", "start", "stop"]
