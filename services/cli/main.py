"""`pdserve` command line.

`run` drives an in-process engine (no servers); `serve` starts a local cluster (router + prefill
and decode pools as processes, `services/cluster/launcher.py`); `prefill`, `decode` and `router`
start one service each; `generate` is a client of the router (services/cli/client.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys

from services import env
from services.cli import profile as profile_command
from services.cli import run as run_command
from services.cli.sampling import add_prompt_source, add_sampling
from services.cluster.config import ClusterConfig
from services.common.logs import LOG_FORMATS, default_format
from services.common.logs import configure as configure_logging
from services.config.handoff import from_json
from services.config.roles import DecodeConfig, PrefillConfig, RouterConfig, with_env_api_key
from services.flags import add_config_flags, config_from_args, flag_message

# Kept free of torch/transformers/grpc imports so `pdserve --help` answers at once: every command
# imports what it needs inside its own function. Every service flag is generated from a field of
# its role config (services/config/roles.py); only the client commands list their own flags.
SERVICES: dict[str, type] = {
    "serve": ClusterConfig,
    "prefill": PrefillConfig,
    "decode": DecodeConfig,
    "router": RouterConfig,
}


class _HelpFormatter(argparse.HelpFormatter):
    """Wider help columns."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=36)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="pdserve: disaggregated prefill/decode LLM serving"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help: str) -> argparse.ArgumentParser:  # noqa: A002 - argparse's name
        return commands.add_parser(name, help=help, formatter_class=_HelpFormatter)

    run_command.add_run(add("run", help="generate with an in-process engine (no servers)"))
    helps = {
        "serve": "start a local cluster: router + prefill and decode pools",
        "prefill": "start one prefill worker",
        "decode": "start one decode worker",
        "router": "start the router (public Generate API)",
    }
    for name, config_cls in SERVICES.items():
        command = add(name, help=helps[name])
        add_config_flags(command, config_cls)
        command.add_argument(
            "--config-json",
            default=None,
            metavar="JSON",
            help=f"The whole {config_cls.__name__} as JSON, as `pdserve serve` passes it to its "
            "children; replaces every other config flag (fields left out keep their defaults).",
        )
        command.add_argument(
            "--log-format",
            choices=LOG_FORMATS,
            default=default_format(),
            help="stderr logs as text or as one JSON object per line, each with its request "
            "id (default: $PDSERVE_LOG_FORMAT or text; `serve` passes it on to its children); "
            "the level is $PDSERVE_LOGGING_LEVEL (DEBUG, INFO, WARNING, ERROR; default INFO)",
        )
        command.add_argument(
            "--log-file",
            default=None,
            metavar="PATH",
            help="also append the log lines to PATH (`serve`: its own and every child's, one "
            "whole line at a time)",
        )
    profile_command.add_profile(
        add("profile", help="fit the step cost model on this machine (or check it: --check)")
    )
    _add_generate(add("generate", help="send one request to a router and stream the answer"))
    bench = add("bench", help="benchmarks against a running server").add_subparsers(
        dest="bench", required=True
    )
    from services.bench.flags import add_flags

    add_flags(
        bench.add_parser(
            "serve",
            help="open-loop load against an OpenAI HTTP server or pdserve's gRPC API",
            formatter_class=_HelpFormatter,
        )
    )
    from services.cli.status import add_flags as add_status_flags

    add_status_flags(add("status", help="the router's workers: health, load, KV cache, hit rate"))
    reset = add(
        "reset-prefix-cache", help="forget every cached prefix (a router: on all its workers)"
    )
    reset.add_argument(
        "--url", default="127.0.0.1:50051", help="router or worker HOST:PORT (default: %(default)s)"
    )
    reset.add_argument(
        "--timeout", type=float, default=30.0, help="deadline in seconds (default: %(default)s)"
    )
    _add_api_key(reset)
    return parser


def _add_api_key(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-key",
        default=None,
        help="the router's API key (default: $PDSERVE_API_KEY), sent as a bearer token",
    )


def service_config(args: argparse.Namespace) -> object:
    """The role config of a service command (`serve`, `prefill`, `decode`, `router`): from
    `--config-json` when given, else from the flags. Raises ValueError naming a bad flag."""
    config_cls = SERVICES[args.command]
    config: object
    if args.config_json is not None:
        config = from_json(config_cls, args.config_json)
    else:
        config = config_from_args(args, config_cls)
    if isinstance(config, RouterConfig):
        return with_env_api_key(config, os.environ)
    if isinstance(config, ClusterConfig):
        return dataclasses.replace(config, router=with_env_api_key(config.router, os.environ))
    return config


def _add_generate(generate: argparse.ArgumentParser) -> None:
    generate.add_argument(
        "--url", default="127.0.0.1:50051", help="router HOST:PORT (default: %(default)s)"
    )
    add_prompt_source(generate)
    add_sampling(generate)
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument(
        "--cache-salt", default="", help="share cached prefixes only with requests of this salt"
    )
    generate.add_argument(
        "--timeout", type=float, default=300.0, help="request deadline in seconds (default: 300)"
    )
    _add_api_key(generate)


def _serve(args: argparse.Namespace) -> int:
    from services.cluster import launcher, supervisor
    from services.engine.loader import model_limits, resolve_model

    config = service_config(args)
    assert isinstance(config, ClusterConfig)
    if config.prometheus_targets:
        from services.cluster.prometheus_targets import check_path

        check_path(config.prometheus_targets)  # refused before anything starts
    os.environ[env.LOG_FORMAT] = args.log_format  # the children log as this process does
    # The children inherit $PDSERVE_LOGGING_LEVEL and log to their stderr only: the supervisor
    # relays their lines into the log file, so one process writes it.
    _configure_logging(args, "serve")
    # What every child would refuse, refused before any starts (no torch here: config.json).
    model_limits(resolve_model(config.engine.model), config.engine.max_model_len)
    plan = launcher.placement_plan(config)
    return supervisor.Supervisor(launcher.cluster_spec(config, plan)).run()


def _configure_logging(args: argparse.Namespace, role: str) -> None:
    """stderr (and `--log-file`) logs at $PDSERVE_LOGGING_LEVEL; ValueError naming the flag or
    the variable."""
    try:
        configure_logging(args.log_format, role, log_file=args.log_file)
    except ValueError as exc:
        if not str(exc).startswith("log_file: "):
            raise
        raise ValueError(f"--log-file: {str(exc).removeprefix('log_file: ')}") from exc


def _service(args: argparse.Namespace) -> int:
    """`services.<role>.server.serve(config)`: prints its ready line and blocks until
    SIGINT/SIGTERM. A worker pins its CPUs and sets its threads first."""
    config = service_config(args)
    _configure_logging(args, args.command)
    if isinstance(config, (PrefillConfig, DecodeConfig)):
        from services.worker.cpus import apply_cpu_placement

        # Before the server module imports torch: OpenMP sizes its pool from the affinity mask.
        # A lending worker may run on every CPU of its node's ledger; its team starts on its own.
        threads = apply_cpu_placement(config.threads or _cpu_count(config.cpus), _cpus(config))
        config = dataclasses.replace(config, threads=threads)
    elif isinstance(config, RouterConfig):
        from services.worker.cpus import pin_cpus

        pin_cpus(config.cpus)  # no torch in the router
    server = importlib.import_module(f"services.{args.command}.server")
    server.serve(config)
    return 0


def _cpu_count(cpus: str | None) -> int | None:
    from services.worker.cpus import parse_cpu_list

    return len(parse_cpu_list(cpus)) if cpus else None


def _cpus(config: PrefillConfig | DecodeConfig) -> str | None:
    """The CPUs a worker process may run on: its own, or with a core ledger every CPU it lists."""
    if config.core_ledger is None:
        return config.cpus
    from services.worker.core_ledger import CoreLedger
    from services.worker.cpus import format_cpus

    return format_cpus(CoreLedger.cpus_of(config.core_ledger))


def _generate(args: argparse.Namespace) -> int:
    from services.cli import client

    return client.main(args)


def _bench(args: argparse.Namespace) -> int:
    from services.bench import command

    return command.main(args)


def _status(args: argparse.Namespace) -> int:
    from services.cli import status

    return status.main(args)


def _reset_prefix_cache(args: argparse.Namespace) -> int:
    from services.cli import client

    return client.reset_prefix_cache(args)


COMMANDS = {
    "run": run_command.run,
    "profile": profile_command.profile,
    "serve": _serve,
    "prefill": _service,
    "decode": _service,
    "router": _service,
    "generate": _generate,
    "bench": _bench,
    "reset-prefix-cache": _reset_prefix_cache,
    "status": _status,
}


def _user_error_types() -> tuple[type[BaseException], ...]:
    """Bad flags, input or model folder. An EngineError can only have been raised once its module
    was imported, so look it up instead of importing the engine (and torch) for every command."""
    errors = sys.modules.get("services.engine.errors")
    return (ValueError, OSError) + ((errors.EngineError,) if errors is not None else ())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except Exception as exc:
        if not isinstance(exc, _user_error_types()):
            raise
        print(f"pdserve: error: {flag_message(args, str(exc))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
