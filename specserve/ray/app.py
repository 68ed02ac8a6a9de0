"""The Ray Serve application run by `specserve serve`: N engine replicas, each its own deployment
(`specserve-replica-i`, so the front door addresses it by index), behind one front door."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any, cast

import ray
from ray import serve
from ray.serve import Application, Deployment

from specserve.ray.frontdoor import FrontDoor, RouterOptions
from specserve.ray.replica import SpecserveReplica
from specserve.server.cli_args import ServerConfig

logger = logging.getLogger(__name__)
APP_NAME = "specserve"


def build_openai_app(
    engine_kwargs: dict[str, Any] | None = None,
    num_replicas: int = 2,
    settings: ServerConfig | None = None,
    *,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    router: RouterOptions | None = None,
) -> Application:
    """`num_replicas` engines from `engine_kwargs` (`LLM(...)`'s names) behind one front door."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas (data_parallel_size) must be >= 1, got {num_replicas}.")
    replica, front_door = cast(Deployment, SpecserveReplica), cast(Deployment, FrontDoor)
    drain_s = (settings or ServerConfig()).graceful_shutdown_timeout  # in-flight requests may finish
    actor = {"num_cpus": num_cpus, "num_gpus": num_gpus}
    opts = [
        replica.options(name=f"specserve-replica-{i}", graceful_shutdown_timeout_s=drain_s, ray_actor_options=actor)
        for i in range(num_replicas)
    ]
    replicas = [o.bind(dict(engine_kwargs or {}), settings) for o in opts]
    return front_door.options(name="specserve-front-door").bind(replicas, router or RouterOptions())


def start(
    engine_kwargs: dict[str, Any],
    num_replicas: int,
    settings: ServerConfig,
    ray_address: str | None = None,
    router: RouterOptions | None = None,
    ray_init: dict[str, Any] | None = None,
) -> str:
    """Start (or join) Ray, deploy the application and wait for it; return the front door's URL."""
    if not ray.is_initialized():
        ray.init(address=ray_address, include_dashboard=False, **(ray_init or {}))
    gpus = float(engine_kwargs.get("tensor_parallel_size", 1)) if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(
        build_openai_app(engine_kwargs, num_replicas, settings, num_gpus=gpus, router=router),
        name=APP_NAME,
        route_prefix="/",
    )
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    return f"http://{host}:{settings.port}"


def stop(joined: bool) -> None:
    """Remove the application; shut Serve and Ray down when this process started them."""
    serve.delete(APP_NAME) if joined else serve.shutdown()
    ray.shutdown()


def serve_ray(engine_kwargs: dict[str, Any], settings: ServerConfig, num_replicas: int, ray_address: str | None) -> int:
    """`specserve serve --data-parallel-backend ray`: serve until SIGTERM / SIGINT, then stop."""
    done = threading.Event()
    try:
        ray.init(address=ray_address, include_dashboard=False)
        for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs its own
            signal.signal(sig, lambda *_: done.set())
        url = start(engine_kwargs, num_replicas, settings, ray_address)
        logger.info("serving %d replica(s) through Ray Serve at %s", num_replicas, url)
        print(f"specserve: {num_replicas} replica(s) ready at {url}", flush=True)
        while not done.wait(0.5):
            pass
    except RuntimeError as e:  # deployment failed (e.g. a replica could not load the model)
        logger.error("Ray Serve deployment failed: %s", e)
        return 1
    finally:
        if ray.is_initialized():
            stop(joined=ray_address is not None)
    return 0
