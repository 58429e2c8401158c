"""``llmbatch engines list | deploy | scale | stop | render``: the shared engines of the model registry.

Each model of ``LLMBATCH_ENGINES__MODELS`` runs as one Ray Serve application on the cluster
(:mod:`llmbatch.ray_job.engines.serve_engine`). ``deploy`` applies the registry to the cluster (the dispatcher
does the same when it starts, with ``LLMBATCH_DISPATCHER__DEPLOY_ENGINES`` on); ``scale`` and ``stop``
change one model until the next deploy from settings. ``render`` prints the same Serve config for a
manifest (a KubeRay RayService's ``serveConfigV2``), without secrets. Every command takes ``--json``
where it prints a table.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from pydantic import ValidationError
from rich.table import Table

from llmbatch.dispatcher.backends.engines import (
    EngineStatus,
    cluster_serve_config,
    summarize,
    with_figures,
    with_scaling,
    without,
)
from llmbatch.dispatcher.backends.runner_backend import RunnerClient
from llmbatch.dispatcher.backends.serve_api import ServeApi
from llmbatch.dispatcher.errors import DispatcherError
from llmbatch.dispatcher.ops.common import OpsError, emit_json, err, fail, load_settings, out, run
from llmbatch.dispatcher.settings import SECRET_ENV_NAME, DispatcherSettings, secret_values
from llmbatch.schemas.engines import EngineRegistry, UnknownModelError
from llmbatch.settings import parse_env_file

app = typer.Typer(
    help="Inspect and manage the shared engines (one Ray Serve application per model).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON on stdout instead of a table.")]
Model = Annotated[str, typer.Argument(help="A model name of the registry (LLMBATCH_ENGINES__MODELS).")]


def load(ctx: typer.Context | None) -> DispatcherSettings:
    """The dispatcher's settings (the registry lives there); a bad environment is a usage error."""
    try:
        return load_settings(ctx, DispatcherSettings)
    except OpsError as exc:
        raise typer.BadParameter(str(exc)) from None


def _known(registry: EngineRegistry, model: str) -> None:
    try:
        registry.get(model)
    except UnknownModelError as exc:
        raise OpsError(str(exc)) from None


def _print(rows: list[EngineStatus], as_json: bool) -> None:
    if as_json:
        emit_json({"engines": [r.__dict__ | {"running": r.running} for r in rows]})
        return
    table = Table(
        "model",
        "application",
        "status",
        "replicas",
        "min..max",
        "queued",
        "on engine",
        "idle",
        "tok/s",
        "cold starts",
        "message",
    )
    for r in rows:
        replicas = ", ".join(f"{n} {state.lower()}" for state, n in sorted(r.replicas.items())) or "0"
        table.add_row(
            r.model,
            r.app,
            r.status,
            replicas,
            f"{r.min_replicas}..{r.max_replicas}",
            *r.figure_cells(),
            r.message,
        )
    out.print(table)


@app.command("list")
def list_command(ctx: typer.Context, json_output: JsonOption = False) -> None:
    """Each model of the registry: its Serve application, status, replicas and, from the engines'
    metrics (through the batch runner, about 10 s old), queued and running requests, idle time,
    tokens/s and cold starts."""
    settings = load(ctx)

    async def body() -> list[EngineStatus]:
        details = await ServeApi.of(settings.ray).status()
        rows = summarize(settings.engines, details)
        try:
            figures = await RunnerClient.of(settings.ray, timeout_s=15).engines()
        except DispatcherError as exc:
            err.print(
                f"engine figures unavailable (the batch runner at {settings.ray.serve_address} did "
                f"not answer: {exc})"
            )
            figures = {}
        return with_figures(rows, figures)

    rows = run(body)
    if not rows:
        err.print("no models configured (LLMBATCH_ENGINES__MODELS)")
    _print(rows, json_output)


def _apply(
    settings: DispatcherSettings, registry: EngineRegistry, shown: EngineRegistry | None = None
) -> list[EngineStatus]:
    """Deploy ``registry``; report on ``shown`` (default the same)."""

    async def body() -> list[EngineStatus]:
        api = ServeApi.of(settings.ray, timeout_s=120)
        await api.deploy(cluster_serve_config(settings, registry))
        return summarize(shown or registry, await api.status())

    return run(body)


@app.command()
def deploy(ctx: typer.Context, json_output: JsonOption = False) -> None:
    """Apply the registry to the cluster (adds, changes and removes applications to match it)."""
    settings = load(ctx)
    _print(_apply(settings, settings.engines), json_output)


@app.command()
def scale(
    ctx: typer.Context,
    model: Model,
    min_replicas: Annotated[int | None, typer.Option("--min", min=0, help="Replicas kept when idle.")] = None,
    max_replicas: Annotated[int | None, typer.Option("--max", min=1, help="Most replicas.")] = None,
    json_output: JsonOption = False,
) -> None:
    """Change one model's replica range (until the next deploy from settings)."""
    settings = load(ctx)
    changes: dict[str, Any] = {}
    if min_replicas is not None:
        changes["min_replicas"] = min_replicas
    if max_replicas is not None:
        changes["max_replicas"] = max_replicas
    if not changes:
        raise typer.BadParameter("give --min and/or --max")

    def registry() -> EngineRegistry:
        _known(settings.engines, model)
        return with_scaling(settings.engines, model, **changes)

    try:
        scaled = registry()
    except ValidationError as exc:
        raise typer.BadParameter(exc.errors(include_url=False)[0]["msg"]) from None
    except OpsError as exc:
        raise typer.BadParameter(str(exc)) from None
    _print(_apply(settings, scaled), json_output)


@app.command()
def stop(ctx: typer.Context, model: Model, json_output: JsonOption = False) -> None:
    """Remove one model's application (its replicas stop; batches of it wait, then fail)."""
    settings = load(ctx)
    try:
        _known(settings.engines, model)
    except OpsError as exc:
        raise typer.BadParameter(str(exc)) from None
    _print(_apply(settings, without(settings.engines, model), settings.engines), json_output)


# --- render: the Serve config for a manifest -------------------------------------------------------


class RenderFormat(StrEnum):
    serve_config = "serve-config"
    rayservice = "rayservice"


# environment variable names that carry credentials: never written into a manifest

RAYSERVICE_HEADER = """\
# Generated by `llmbatch engines render --format rayservice` from this overlay's settings (base, overlay
# settings.env; see deploy/README.md): the RayService's spec.serveConfigV2. Do not edit by hand; a unit
# test fails when it differs from the generator's output.
"""


def manifest_serve_config(settings: DispatcherSettings) -> dict[str, Any]:
    """:func:`~llmbatch.dispatcher.backends.engines.cluster_serve_config` as a manifest may carry it: no
    secret values.

    The config never carries the S3 keys or the Redis password (the Ray pods have them from their
    Secret, and Serve replicas inherit the pod environment). A secret value of the settings that
    ``job.env_vars`` would copy in, or an environment variable named like a credential, is refused:
    a Kubernetes manifest is no place for them."""
    config = cluster_serve_config(settings)
    problems = [f"{where} (a secret value of the settings)" for where in _secret_leaks(config, settings)]
    problems += [f"{where} (a credential's name)" for where in _secret_named_env(config)]
    if problems:
        raise OpsError(
            "the Serve config would carry secrets: "
            + ", ".join(problems)
            + "; take them from the Ray pods' environment (secretKeyRef) instead"
        )
    return config


def serve_config_yaml(config: dict[str, Any]) -> str:
    """The Serve config as YAML text (what a RayService's ``serveConfigV2`` holds)."""
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False, width=10_000)


class _Block(str):
    """A multi-line string written as a YAML literal block (``|``)."""


class _Dumper(yaml.SafeDumper):
    pass


def _block(dumper: yaml.SafeDumper, data: _Block) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", str(data), style="|")


_Dumper.add_representer(_Block, _block)


def rayservice_patch(config: dict[str, Any], name: str = "llmbatch-ray") -> str:
    """A RayService document carrying only ``spec.serveConfigV2`` (a kustomize patch of the overlay)."""
    doc = {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": name},
        "spec": {"serveConfigV2": _Block(serve_config_yaml(config))},
    }
    body: str = yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=10_000)
    return RAYSERVICE_HEADER + body


def _strings(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _strings(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _strings(value, f"{path}[{i}]")
    elif isinstance(node, str):
        yield path, node


def _secret_leaks(config: dict[str, Any], settings: DispatcherSettings) -> list[str]:
    """Where ``config`` holds a secret value of ``settings`` (whole, or inside a longer string)."""
    secrets = list(secret_values(settings))
    return [
        f"{where} = <{name}>"
        for where, text in _strings(config)
        for name, secret in secrets
        if text == secret or (len(secret) >= 8 and secret in text)
    ]


def _secret_named_env(config: dict[str, Any]) -> list[str]:
    found = []
    for app_config in config.get("applications") or []:
        env = (app_config.get("runtime_env") or {}).get("env_vars") or {}
        # an empty value is a blank (ray_job.storage.node_secrets: what a replica is started without),
        # no secret
        found += [
            f"{app_config.get('name')}: {key}"
            for key, value in env.items()
            if value and SECRET_ENV_NAME.search(key)
        ]
    return found


@contextlib.contextmanager
def only_llmbatch_env(env: dict[str, str]) -> Iterator[None]:
    """The process sees exactly ``env`` as its ``LLMBATCH_*`` variables, for the block's duration."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("LLMBATCH_")}
    try:
        for key in saved:
            del os.environ[key]
        os.environ.update({k: v for k, v in env.items() if k.startswith("LLMBATCH_")})
        yield
    finally:
        for key in [k for k in os.environ if k.startswith("LLMBATCH_")]:
            del os.environ[key]
        os.environ.update(saved)


def settings_from_env_files(paths: list[Path]) -> DispatcherSettings:
    """The settings an overlay's ConfigMap gives: its env files merged in order (later files win, as
    kustomize's ``behavior: merge``), nothing from this process's environment or ``.env``."""
    env: dict[str, str] = {}
    for path in paths:
        try:
            env.update(parse_env_file(path))
        except ValueError as exc:
            raise OpsError(str(exc)) from None
    try:
        with only_llmbatch_env(env):
            return DispatcherSettings(_env_file=None)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        raise OpsError(f"invalid setting {where} in the env files: {first['msg']}") from None


def render_text(settings: DispatcherSettings, output: RenderFormat, name: str = "llmbatch-ray") -> str:
    """What ``llmbatch engines render`` prints."""
    config = manifest_serve_config(settings)
    if output is RenderFormat.rayservice:
        return rayservice_patch(config, name)
    return serve_config_yaml(config)


@app.command()
def render(
    ctx: typer.Context,
    output: Annotated[
        RenderFormat,
        typer.Option(
            "--format",
            help="serve-config: the Serve config (YAML, a RayService's serveConfigV2); "
            "rayservice: a RayService patch carrying it (overlays/gpu-prod-rayservice/serve-config.yaml).",
        ),
    ] = RenderFormat.serve_config,
    env_file: Annotated[
        list[Path] | None,
        typer.Option(
            "--env-file",
            exists=True,
            dir_okay=False,
            readable=True,
            help="Read the settings from these KEY=VALUE files only, merged in order (e.g. base, then "
            "overlay settings.env), instead of the LLMBATCH_* environment. Repeatable.",
        ),
    ] = None,
    name: Annotated[str, typer.Option("--name", help="The RayService's metadata.name (rayservice).")] = (
        "llmbatch-ray"
    ),
) -> None:
    """Print the registry's Serve config (what `deploy` applies) for a manifest, without secrets."""
    try:
        settings = settings_from_env_files(env_file) if env_file else load(ctx)
        text = render_text(settings, output, name)
    except OpsError as exc:
        fail(str(exc), exc.code)
    typer.echo(text, nl=False)
