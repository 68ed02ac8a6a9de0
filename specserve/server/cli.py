"""The `specserve` command. Subcommands import what they need when they run.
Exit codes: 0 ok, 1 runtime failure, 2 bad arguments/configuration."""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from specserve.config import DEFAULT_MODEL

if TYPE_CHECKING:
    from specserve.server.cli_args import ServerConfig

T = TypeVar("T")

SUBCOMMANDS = {
    "serve": "run the OpenAI-compatible server",
    "generate": "generate text for prompts (arguments or stdin) and print tokens/s",
    "chat": "chat with a model in the terminal",
    "bench": "load-test a running server (throughput, TTFT, ITL, goodput)",
    "advise": "read a running server's /metrics and suggest settings",
    "models": "list, install and locate catalog models (models list|install|path)",
    "train-draft": "train a draft head for speculative decoding",
}


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="LLM inference engine and server.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_ in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    return parser


def _config_or_exit(prog: str, build: Callable[[], T]) -> T:
    try:
        return build()
    except (ValueError, TypeError, OSError) as e:  # bad flag values, missing model files
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def serve_main(argv: Sequence[str]) -> int:
    from specserve.config import EngineConfig
    from specserve.server import cli_args

    parser = argparse.ArgumentParser(prog="specserve serve", description=SUBCOMMANDS["serve"])
    cli_args.add_engine_args(parser)
    cli_args.add_server_args(parser)
    cli_args.add_data_parallel_args(parser)
    args = parser.parse_args(argv)
    settings = _config_or_exit("specserve serve", lambda: cli_args.server_config(args))
    config = _config_or_exit("specserve serve", lambda: EngineConfig.from_kwargs(**cli_args.engine_kwargs(args)))
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    if _config_or_exit("specserve serve", lambda: cli_args.wants_data_parallel(args)):
        return _serve_ray(cli_args.engine_kwargs(args), settings, args)

    from specserve.engine.async_engine import AsyncEngine
    from specserve.server.api import bind_socket, make_server

    sock = _config_or_exit("specserve serve", lambda: bind_socket(settings.host, settings.port))
    _config_or_exit("specserve serve", lambda: cli_args.apply_num_threads(args))
    engine = _config_or_exit("specserve serve", lambda: AsyncEngine.from_config(config))
    server = make_server(engine, settings)
    # Start-up objects live as long as the server: keep full collections from walking them.
    gc.collect()
    gc.freeze()
    # uvicorn re-raises the caught signal after its graceful shutdown: a no-op handler exits with 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        engine.close(timeout=2.0)  # no-op when the app's lifespan already shut it down
    return 0 if server.started and server.engine_died_at is None else 1


def _serve_ray(engine_kwargs: dict[str, Any], settings: ServerConfig, args: argparse.Namespace) -> int:
    try:  # by name, as bench and advise: the ray front end builds on server, not the other way
        serve_ray = importlib.import_module("specserve.ray.app").serve_ray
    except ModuleNotFoundError as e:
        if e.name is None or not e.name.startswith("ray"):
            raise
        msg = "--data-parallel-backend ray needs Ray Serve: pip install 'specserve[ray]'"
        print(f"specserve serve: error: {msg}", file=sys.stderr)
        return 2
    return serve_ray(engine_kwargs, settings, args.data_parallel_size, args.ray_address)


def _offline(name: str, argv: Sequence[str], add_flags: Callable[[argparse.ArgumentParser], None]) -> tuple:
    """(args, SamplingParams, a function loading the LLM) of `generate` / `chat`."""
    from specserve import LLM
    from specserve.server import cli_args

    prog = f"specserve {name}"
    parser = argparse.ArgumentParser(prog=prog, description=SUBCOMMANDS[name])
    cli_args.add_engine_args(parser)
    cli_args.add_sampling_args(parser)
    add_flags(parser)
    args = parser.parse_args(argv)
    params = _config_or_exit(prog, lambda: cli_args.sampling_params(args))

    def load() -> LLM:
        _config_or_exit(prog, lambda: cli_args.apply_num_threads(args))
        return _config_or_exit(prog, lambda: LLM(**{"model": DEFAULT_MODEL, **cli_args.engine_kwargs(args)}))

    return args, params, load


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt:
        return list(args.prompt)
    if sys.stdin.isatty():
        print("Enter a prompt, then Ctrl-D:", file=sys.stderr)
    text = sys.stdin.read()
    prompts = [line for line in text.splitlines() if line.strip()] if args.lines else [text.rstrip("\n")]
    return [p for p in prompts if p]


def generate_main(argv: Sequence[str]) -> int:
    def flags(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("-p", "--prompt", action="append", help="a prompt (repeatable); default: stdin")
        parser.add_argument("--lines", action="store_true", help="stdin holds one prompt per line")

    args, params, load = _offline("generate", argv, flags)
    prompts = _read_prompts(args)
    if not prompts:
        print("specserve generate: error: no prompt given", file=sys.stderr)
        return 2
    llm = load()
    start = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params)
    except ValueError as e:
        print(f"specserve generate: error: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    num_tokens = 0
    single = len(prompts) == 1 and params.n == 1
    for out in outputs:
        for c in out.outputs:
            num_tokens += len(c.token_ids)
            print(c.text if single else f"--- [{c.index}] {out.prompt!r}\n{c.text}")
    rate = num_tokens / max(elapsed, 1e-9)
    print(f"\n{len(outputs)} prompt(s), {num_tokens} tokens in {elapsed:.2f} s ({rate:.1f} tokens/s)", file=sys.stderr)
    return 0


def chat_main(argv: Sequence[str]) -> int:
    args, params, load = _offline("chat", argv, lambda p: p.add_argument("--system", help="system prompt"))
    llm = load()
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("specserve chat: empty line or Ctrl-D to quit; /reset clears the history.", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        if line == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        try:
            reply = llm.chat(messages, params)[0].outputs[0].text
        except ValueError as e:  # e.g. the history outgrew the context
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            continue
        print(reply)
        messages.append({"role": "assistant", "content": reply})
    return 0


def _delegate_args(module: str, add: str, run: str, name: str, argv: Sequence[str]) -> int:
    mod = importlib.import_module(module)
    parser = argparse.ArgumentParser(prog=f"specserve {name}", description=SUBCOMMANDS[name])
    getattr(mod, add)(parser)
    return int(getattr(mod, run)(parser.parse_args(argv)) or 0)


def _delegate(module: str, run: str, argv: Sequence[str]) -> int:
    return int(getattr(importlib.import_module(module), run)(list(argv)) or 0)


_RUNNERS: dict[str, Callable[[Sequence[str]], int]] = {
    "serve": serve_main,
    "generate": generate_main,
    "chat": chat_main,
    "bench": lambda argv: _delegate_args("specserve.bench.serving", "add_bench_args", "bench_main", "bench", argv),
    "advise": lambda argv: _delegate_args("specserve.bench.advise", "add_advise_args", "advise_main", "advise", argv),
    "models": lambda argv: _delegate("specserve.model.catalog", "models_main", argv),
    "train-draft": lambda argv: _delegate("specserve.train.loop", "train_main", argv),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in _RUNNERS:
        parser = _top_parser()
        if argv and argv[0] not in ("-h", "--help"):
            parser.error(f"unknown command {argv[0]!r} (choose from {', '.join(SUBCOMMANDS)})")
        parser.print_help()
        return 0 if argv else 2
    try:
        return _RUNNERS[argv[0]](argv[1:])
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
