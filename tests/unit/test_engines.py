"""The engine registry contract and its Serve config (pure)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from dispatcher.engines import replica_pids, serve_config, summarize, with_scaling, without
from ray_job.serve_engine import IMPORT_PATH, deployment_options, serve_application
from schemas.engines import (
    DEPLOYMENT_NAME,
    EngineModel,
    EngineRegistry,
    ReplicaResources,
    Scaling,
    UnknownModelError,
    app_name,
)
from schemas.job import EngineConfig

pytestmark = pytest.mark.unit


def _registry() -> EngineRegistry:
    return EngineRegistry(models={
        "Qwen/Qwen2.5-0.5B-Instruct": EngineModel(
            path="/models/qwen",
            engine=EngineConfig(enforce_eager=True),
            resources=ReplicaResources(num_cpus=2, num_gpus=1, resources={"llmbatch_engine": 1}),
            scaling=Scaling(min_replicas=0, max_replicas=4, idle_s=120, target_ongoing_requests=2),
        ),
        "small": EngineModel(path="/models/small"),
    })


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
    [({"min_replicas": 3, "max_replicas": 2}, "min_replicas"),
     ({"min_replicas": 0, "max_replicas": 2, "initial_replicas": 5}, "initial_replicas"),
     ({"max_replicas": 0}, "max_replicas")],
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
        "min_replicas": 0, "max_replicas": 4, "target_ongoing_requests": 2.0,
        "downscale_delay_s": 120.0, "upscale_delay_s": 0.0,
    }
    assert options["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 1.0,
                                            "resources": {"llmbatch_engine": 1.0}}
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
        assert app["runtime_env"] == {"env_vars": {"VLLM_CACHE_ROOT": "/cache"}}
        # the builder gets back exactly the registry entry
        model = app["args"]["model"]
        assert EngineModel.model_validate(app["args"]["entry"]) == registry.get(model)
        [deployment] = app["deployments"]
        assert deployment["name"] == DEPLOYMENT_NAME


def test_serve_application_env_merges_entry_env_under_the_dispatcher_env() -> None:
    entry = EngineModel(path="/m", env_vars={"A": "entry", "B": "entry"})
    app = serve_application("m", entry, {"B": "dispatcher"})
    assert app["runtime_env"] == {"env_vars": {"A": "entry", "B": "dispatcher"}}
    assert "runtime_env" not in serve_application("m", EngineModel(path="/m"))


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


def test_summarize_reads_serve_details() -> None:
    registry = _registry()
    small = app_name("small")
    details = {"applications": {small: {"status": "RUNNING", "deployments": {DEPLOYMENT_NAME: {
        "status": "HEALTHY", "message": "",
        "replicas": [{"state": "RUNNING", "pid": 11}, {"state": "STARTING", "pid": None},
                     {"state": "RUNNING", "pid": 12}],
    }}}}}
    rows = {r.model: r for r in summarize(registry, details)}
    assert rows["small"].status == "RUNNING" and rows["small"].running == 2
    assert rows["small"].replicas == {"RUNNING": 2, "STARTING": 1}
    assert rows["Qwen/Qwen2.5-0.5B-Instruct"].status == "NOT_DEPLOYED"
    assert rows["Qwen/Qwen2.5-0.5B-Instruct"].max_replicas == 4
    assert replica_pids(details, "small") == [11, 12]
    assert replica_pids(details, "Qwen/Qwen2.5-0.5B-Instruct") == []
