"""The engine registry contract and its Serve config (pure)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from typer.testing import CliRunner

from llmbatch.dispatcher.backends.engines import (
    cluster_serve_config,
    config_lost,
    replica_pids,
    serve_config,
    serve_controller,
    summarize,
    with_scaling,
    without,
)
from llmbatch.dispatcher.job_options import JobOptions
from llmbatch.dispatcher.ops.common import OpsError
from llmbatch.dispatcher.ops.engines_cli import (
    RenderFormat,
    manifest_serve_config,
    rayservice_patch,
    render_text,
    serve_config_yaml,
    settings_from_env_files,
)
from llmbatch.dispatcher.ops.engines_cli import app as engines_app
from llmbatch.dispatcher.settings import DispatcherOptions, DispatcherSettings
from llmbatch.ray_job.batch_runner.runner_http import APP_NAME as RUNNER_APP
from llmbatch.ray_job.engines.serve_engine import IMPORT_PATH, deployment_options, serve_application
from llmbatch.ray_job.storage import node_secrets
from llmbatch.schemas.engines import (
    DEPLOYMENT_NAME,
    EngineModel,
    EngineRegistry,
    ReplicaResources,
    Scaling,
    UnknownModelError,
    app_name,
)
from llmbatch.schemas.job import EngineConfig
from llmbatch.settings import RaySettings, RedisSettings, S3Settings

BLANKS = node_secrets.withheld(node_secrets.ALL)  # what an engine replica is started without

pytestmark = pytest.mark.unit


def _registry() -> EngineRegistry:
    return EngineRegistry(
        models={
            "Qwen/Qwen2.5-0.5B-Instruct": EngineModel(
                path="/models/qwen",
                engine=EngineConfig(enforce_eager=True),
                resources=ReplicaResources(num_cpus=2, num_gpus=1, resources={"llmbatch_engine": 1}),
                scaling=Scaling(min_replicas=0, max_replicas=4, idle_s=120, target_ongoing_requests=2),
            ),
            "small": EngineModel(path="/models/small"),
        }
    )


def test_app_names_are_stable_distinct_and_url_safe() -> None:
    a, b = app_name("Qwen/Qwen2.5-0.5B-Instruct"), app_name("qwen/qwen2.5-0.5b-instruct")
    assert a == app_name("Qwen/Qwen2.5-0.5B-Instruct")
    assert a != b  # same slug, different model: the digest keeps them apart
    assert a.startswith("llmbatch-engine-qwen-qwen2-5-0-5b-instruct-")
    assert all(c.isalnum() or c == "-" for c in a)


def test_unknown_model_names_the_served_ones() -> None:
    registry = _registry()
    with pytest.raises(UnknownModelError) as err:
        registry.get("no-such-model")
    assert "no-such-model" in str(err.value) and "'small'" in str(err.value)
    assert err.value.known == ["Qwen/Qwen2.5-0.5B-Instruct", "small"]
    assert "small" in registry and "no-such-model" not in registry


@pytest.mark.parametrize(
    ("scaling", "field"),
    [
        ({"min_replicas": 3, "max_replicas": 2}, "min_replicas"),
        ({"min_replicas": 0, "max_replicas": 2, "initial_replicas": 5}, "initial_replicas"),
        ({"max_replicas": 0}, "max_replicas"),
    ],
)
def test_incoherent_scaling_is_refused_naming_the_field(scaling: dict[str, int], field: str) -> None:
    with pytest.raises(ValidationError) as err:
        EngineModel.model_validate({"path": "/m", "scaling": scaling})
    assert field in str(err.value)


def test_entry_refuses_empty_path_and_unknown_keys() -> None:
    with pytest.raises(ValidationError, match="path"):
        EngineModel.model_validate({"path": ""})
    with pytest.raises(ValidationError, match="replicas"):
        EngineModel.model_validate({"path": "/m", "replicas": 2})


def test_deployment_options_follow_the_entry() -> None:
    entry = _registry().get("Qwen/Qwen2.5-0.5B-Instruct")
    options = deployment_options(entry)
    assert options["name"] == DEPLOYMENT_NAME
    assert options["autoscaling_config"] == {
        "min_replicas": 0,
        "max_replicas": 4,
        "target_ongoing_requests": 2.0,
        "downscale_delay_s": 120.0,
        "upscale_delay_s": 0.0,
        "policy": {  # Serve's rule, and deadline demand (more replicas while at-risk requests wait)
            "policy_function": "llmbatch.ray_job.engines.engine_scaling:DeadlineAwarePolicy",
            "policy_kwargs": {"slots_per_replica": entry.max_active_requests},
        },
    }
    assert options["ray_actor_options"] == {
        "num_cpus": 2.0,
        "num_gpus": 1.0,
        "resources": {"llmbatch_engine": 1.0},
    }
    assert options["max_ongoing_requests"] == entry.scaling.max_ongoing_requests


def test_serve_config_has_one_handle_only_app_per_model() -> None:
    registry = _registry()
    config = serve_config(registry, {"VLLM_CACHE_ROOT": "/cache"}, http_address="http://127.0.0.1:18000")
    # the proxy always runs, with the options of the settings (Serve keeps those of its first deploy)
    assert config["proxy_location"] == "HeadOnly"
    assert config["http_options"] == {"host": "127.0.0.1", "port": 18000}
    apps = config["applications"]
    assert [a["name"] for a in apps] == [app_name(m) for m in sorted(registry.models)]
    for app in apps:
        assert app["import_path"] == IMPORT_PATH and app["route_prefix"] is None
        assert app["runtime_env"] == {"env_vars": {"VLLM_CACHE_ROOT": "/cache", **BLANKS}}
        # the builder gets back exactly the registry entry
        model = app["args"]["model"]
        assert EngineModel.model_validate(app["args"]["entry"]) == registry.get(model)
        [deployment] = app["deployments"]
        assert deployment["name"] == DEPLOYMENT_NAME


def test_the_tenants_weights_go_to_every_engine_and_only_when_set() -> None:
    base = DispatcherSettings(ray=RaySettings(address="http://127.0.0.1:8265"), engines=_registry())
    plain = cluster_serve_config(base)
    assert all("tenant_weights" not in app["args"] for app in plain["applications"])  # unchanged config
    weighted = base.model_copy(
        update={"tenants": base.tenants.model_copy(update={"weights": {"gold": 2.0, "acme": 0.5}})}
    )
    apps = [a for a in cluster_serve_config(weighted)["applications"] if a["import_path"] == IMPORT_PATH]
    assert [app["args"]["tenant_weights"] for app in apps] == [{"acme": 0.5, "gold": 2.0}] * 2


@pytest.mark.parametrize(
    ("weights", "named"),
    [
        ({"gold": 0}, "gold"),
        ({"gold": -1}, "gold"),
        ({"gold": 1001}, "gold"),
        ({"Not A Tenant": 1}, "Not A Tenant"),
    ],
)
def test_a_bad_tenant_weight_is_refused_naming_the_tenant(weights: dict[str, float], named: str) -> None:
    from llmbatch.settings import TenantSettings

    with pytest.raises(ValidationError) as info:
        TenantSettings(weights=weights)
    assert "weights" in str(info.value) and named in str(info.value)


def test_omp_threads_of_a_model_set_its_replicas_omp_num_threads() -> None:
    entry = EngineModel(path="/m", resources=ReplicaResources(num_cpus=1, omp_threads=2))
    app = serve_application("m", entry, {"OMP_NUM_THREADS": "1", "B": "dispatcher"})
    # the model's wins
    assert app["runtime_env"]["env_vars"] == {"OMP_NUM_THREADS": "2", "B": "dispatcher", **BLANKS}
    # unset: no variable, Ray gives the actor its num_cpus
    plain = serve_application("m", EngineModel(path="/m", resources=ReplicaResources(num_cpus=1)))
    assert "OMP_NUM_THREADS" not in (plain.get("runtime_env") or {}).get("env_vars", {})
    with pytest.raises(ValidationError):
        ReplicaResources(omp_threads=0)


def test_serve_application_env_merges_entry_env_under_the_dispatcher_env() -> None:
    entry = EngineModel(path="/m", env_vars={"A": "entry", "B": "entry"})
    app = serve_application("m", entry, {"B": "dispatcher"})
    assert app["runtime_env"] == {"env_vars": {"A": "entry", "B": "dispatcher", **BLANKS}}
    assert serve_application("m", EngineModel(path="/m"))["runtime_env"] == {"env_vars": BLANKS}


def test_engine_replicas_are_started_without_the_node_secrets() -> None:
    """Every variable that holds a node secret is set empty in an engine's runtime_env, over whatever the
    entry or the dispatcher would set; weights vLLM reads from s3:// keep the S3 keys."""
    entry = EngineModel(path="/m", env_vars={"AWS_ACCESS_KEY_ID": "from-entry"})
    app = serve_application("m", entry, {"LLMBATCH_REDIS__PASSWORD": "from-dispatcher"})
    env = app["runtime_env"]["env_vars"]
    assert {name: env[name] for name in node_secrets.ALL} == dict.fromkeys(node_secrets.ALL, "")
    from_s3 = serve_application("m", EngineModel(path="s3://models/m"))["runtime_env"]["env_vars"]
    assert from_s3 == {node_secrets.REDIS_PASSWORD: "", node_secrets.RUNNER_TOKEN: ""}


def test_scale_and_stop_change_one_model_only() -> None:
    registry = _registry()
    scaled = with_scaling(registry, "small", min_replicas=1, max_replicas=3)
    assert scaled.get("small").scaling.max_replicas == 3 and scaled.get("small").scaling.min_replicas == 1
    assert scaled.get("small").path == "/models/small"
    assert scaled.get("Qwen/Qwen2.5-0.5B-Instruct") == registry.get("Qwen/Qwen2.5-0.5B-Instruct")
    with pytest.raises(ValidationError):
        with_scaling(registry, "small", min_replicas=5, max_replicas=1)
    assert list(without(registry, "small").models) == ["Qwen/Qwen2.5-0.5B-Instruct"]
    with pytest.raises(UnknownModelError):
        without(registry, "nope")


def test_config_is_lost_only_when_a_new_serve_instance_has_none_of_its_applications() -> None:
    config = serve_config(_registry(), http_address="http://127.0.0.1:8000")
    names = [a["name"] for a in config["applications"]]
    ours, restarted = {"actor_id": "a1"}, {"actor_id": "b2"}

    def serve(controller: dict[str, str] | None, *apps: str) -> dict[str, Any]:
        return {"controller_info": controller or {}, "applications": {a: {"status": "RUNNING"} for a in apps}}

    # a restarted head: Serve not running at all, or a new instance with none (or only someone else's)
    assert serve_controller(serve(None)) is None and serve_controller(serve(ours)) == "a1"
    assert config_lost(config, serve(None), "a1")
    assert config_lost(config, {}, "a1")
    assert config_lost(config, serve(restarted, "someone-else"), "a1")
    # the instance they went to: all there, one removed, or even all removed by `llmbatch engines stop`
    # (that stays so until the next deploy from settings)
    assert not config_lost(config, serve(ours, *names), "a1")
    assert not config_lost(config, serve(ours, names[0]), "a1")
    assert not config_lost(config, serve(ours), "a1")
    # a new instance that has them (another dispatcher deployed them) is not lost either
    assert not config_lost(config, serve(restarted, *names), "a1")
    # nothing to deploy is never lost
    assert not config_lost({"applications": []}, {}, "a1")


def test_summarize_reads_serve_details() -> None:
    registry = _registry()
    small = app_name("small")
    details = {
        "applications": {
            small: {
                "status": "RUNNING",
                "deployments": {
                    DEPLOYMENT_NAME: {
                        "status": "HEALTHY",
                        "message": "",
                        "replicas": [
                            {"state": "RUNNING", "pid": 11},
                            {"state": "STARTING", "pid": None},
                            {"state": "RUNNING", "pid": 12},
                        ],
                    }
                },
            }
        }
    }
    rows = {r.model: r for r in summarize(registry, details)}
    assert rows["small"].status == "RUNNING" and rows["small"].running == 2
    assert rows["small"].replicas == {"RUNNING": 2, "STARTING": 1}
    assert rows["Qwen/Qwen2.5-0.5B-Instruct"].status == "NOT_DEPLOYED"
    assert rows["Qwen/Qwen2.5-0.5B-Instruct"].max_replicas == 4
    assert replica_pids(details, "small") == [11, 12]
    assert replica_pids(details, "Qwen/Qwen2.5-0.5B-Instruct") == []


# --- `llmbatch engines render`: the Serve config for a manifest, without secrets ---------------------

SECRETS = {
    "ak": "AKIA-dummy-key-id",
    "sk": "dummy-s3-secret-key",
    "redis": "dummy-redis-pw",
    "ray": "dummy-ray-token",
}


def _shared(**job: Any) -> DispatcherSettings:
    """Settings as a dispatcher pod has them: shared engines + short path, every secret set."""
    return DispatcherSettings(
        _env_file=None,
        engines=_registry(),
        s3=S3Settings(access_key=SECRETS["ak"], secret_key=SECRETS["sk"]),
        redis=RedisSettings(password=SECRETS["redis"]),
        ray=RaySettings(serve_address="http://ray-head:8000", auth_token=SECRETS["ray"]),
        dispatcher=DispatcherOptions(shared_engines=True),
        job=JobOptions(**{"pass_s3_credentials": False, **job}),
    )


def test_manifest_serve_config_is_the_dispatchers_without_secrets() -> None:
    settings = _shared()
    config = manifest_serve_config(settings)
    text = serve_config_yaml(config)
    assert not [name for name, value in SECRETS.items() if value in text]
    runner = config["applications"][-1]
    assert runner["name"] == RUNNER_APP
    env = runner["runtime_env"]["env_vars"]
    assert {k for k, v in env.items() if v} == {  # where, not keys
        "LLMBATCH_S3__ENDPOINT",
        "AWS_ENDPOINT_URL_S3",
        "AWS_REGION",
        "RAY_worker_niceness",  # the runner at the engine's priority, not Ray's 15
    }
    assert env["RAY_worker_niceness"] == "0"
    assert {k for k, v in env.items() if not v} == set(node_secrets.S3_KEYS)  # its batches bring theirs
    # what the dispatcher deploys itself is the same config: neither carries the Redis password or S3
    # keys (the replicas inherit them from the Ray pods' environment)
    assert config == cluster_serve_config(settings)
    assert yaml.safe_load(text) == config


def test_manifest_serve_config_refuses_s3_keys_and_secret_env() -> None:
    no_runner = _shared().model_copy(update={"dispatcher": DispatcherOptions(shared_engines=False)})
    assert [a["name"] for a in manifest_serve_config(no_runner)["applications"]] == [
        app_name(m) for m in sorted(_registry().models)
    ]
    # the settings refuse a secret in job.env_vars already; render checks the config it makes again
    with pytest.raises(ValidationError, match=r"env_vars\.X holds the value of s3\.secret_key"):
        _shared(env_vars={"X": SECRETS["sk"]})
    with pytest.raises(ValidationError, match="HF_TOKEN"):
        _shared(env_vars={"HF_TOKEN": "hf_public_looking"})
    leaky = _shared().model_copy(update={"job": JobOptions(env_vars={"X": SECRETS["sk"]})})  # unvalidated
    with pytest.raises(OpsError, match=r"env_vars\.X = <s3\.secret_key>"):
        manifest_serve_config(leaky)
    for harmless in ("TOKENIZERS_PARALLELISM", "VLLM_CACHE_ROOT", "KEYRING"):
        assert manifest_serve_config(_shared(env_vars={harmless: "x"}))


def test_rayservice_patch_carries_the_serve_config_as_a_block() -> None:
    config = manifest_serve_config(_shared())
    text = rayservice_patch(config, "svc")
    assert text.startswith("# Generated by `llmbatch engines render --format rayservice`")
    assert "  serveConfigV2: |\n" in text
    doc = yaml.safe_load(text)
    assert doc["kind"] == "RayService" and doc["metadata"] == {"name": "svc"}
    assert doc["spec"] == {"serveConfigV2": serve_config_yaml(config)}


def test_render_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    assert runner.invoke(engines_app, ["render", "--help"]).exit_code == 0
    settings = _shared()
    result = runner.invoke(engines_app, ["render"], obj={"settings": settings})
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.stdout) == manifest_serve_config(settings)
    # --env-file: exactly these files, later ones win; the process environment does not count
    monkeypatch.setenv("LLMBATCH_DISPATCHER__SHORT_PATH_MAX_LINES", "0")
    base, overlay = tmp_path / "base.env", tmp_path / "overlay.env"
    models = json.dumps({m: e.model_dump(mode="json") for m, e in _registry().models.items()})
    base.write_text(
        f"# comment\nLLMBATCH_ENGINES__MODELS={models}\nLLMBATCH_DISPATCHER__SHARED_ENGINES=false\n"
    )
    overlay.write_text("LLMBATCH_DISPATCHER__SHARED_ENGINES=true\nLLMBATCH_JOB__PASS_S3_CREDENTIALS=false\n")
    args = ["render", "--format", "rayservice", "--env-file", str(base), "--env-file", str(overlay)]
    result = runner.invoke(engines_app, args)
    assert result.exit_code == 0, result.output
    assert result.stdout == render_text(settings_from_env_files([base, overlay]), RenderFormat.rayservice)
    served = yaml.safe_load(yaml.safe_load(result.stdout)["spec"]["serveConfigV2"])
    assert served["applications"][-1]["name"] == RUNNER_APP
    # one error line, exit 1
    overlay.write_text("LLMBATCH_JOB__PASS_S3_CREDENTIALS=true\nLLMBATCH_DISPATCHER__SHARED_ENGINES=true\n")
    result = runner.invoke(engines_app, ["render", "--env-file", str(base), "--env-file", str(overlay)])
    assert result.exit_code == 1 and "PASS_S3_CREDENTIALS" in result.output
    overlay.write_text("not a setting line\n")
    result = runner.invoke(engines_app, ["render", "--env-file", str(overlay)])
    assert result.exit_code == 1 and "not KEY=VALUE" in result.output


def test_list_rows_show_figures_or_dashes() -> None:
    from llmbatch.dispatcher.backends.engines import EngineStatus, with_figures

    rows = [
        EngineStatus(model="a", app="x", status="RUNNING"),
        EngineStatus(model="b", app="y", status="RUNNING"),
    ]
    with_figures(
        rows, {"a": {"queued": 3.0, "active": 8.0, "idle_s": None, "tokens_per_s": 12.34, "cold_starts": 2.0}}
    )
    assert rows[0].figure_cells() == ["3", "8", "-", "12.3", "2"]
    assert rows[1].figures is None and rows[1].figure_cells() == ["-"] * 5
