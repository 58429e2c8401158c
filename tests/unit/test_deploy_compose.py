"""docker-compose.yml and .env.example: loaded the way `docker compose config` loads them (compose-go:
compose-spec schema, interpolation from .env.example, profiles), then checked for consistency:
healthchecks, startup order, settings names, ports, volumes, pinned images, commands."""

from __future__ import annotations

import re
from itertools import combinations
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from tests.support.scripts import load_file, load_script

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.unit


vd = load_script("validate_deploy")
dockerfiles = load_script("validate_dockerfiles")
grafana = load_script("validate_dashboard")
PROFILE_SETS = [(), ("cpu",), ("gpu",), ("cpu", "monitoring"), ("gpu", "monitoring")]


@pytest.fixture(scope="module")
def projects() -> dict[tuple[str, ...], dict[str, Any]]:
    return {p: vd.compose_config(p) for p in PROFILE_SETS}


@pytest.fixture(scope="module")
def everything(projects: dict[tuple[str, ...], dict[str, Any]]) -> dict[str, Any]:
    """Every service of every profile."""
    services: dict[str, Any] = {}
    for project in projects.values():
        services.update(project["services"])
    return services


def one_shot(service: dict[str, Any]) -> bool:
    return (service.get("labels") or {}).get("llmbatch.one-shot") == "true"


def env_example() -> dict[str, str]:
    env: dict[str, str] = vd.parse_env_file(vd.ENV_EXAMPLE)
    return env


def test_profiles_select_the_expected_services(projects: dict[tuple[str, ...], dict[str, Any]]) -> None:
    core = {"kafka", "kafka-init", "redis", "minio", "minio-init", "ray-head", "dispatcher", "api"}
    assert set(projects[()]["services"]) == core
    assert set(projects[("cpu",)]["services"]) == core | {"model-init-cpu", "ray-worker-cpu"}
    assert set(projects[("gpu",)]["services"]) == core | {"model-init-gpu", "ray-worker-gpu"}
    assert set(projects[("cpu", "monitoring")]["services"]) == core | {
        "model-init-cpu",
        "ray-worker-cpu",
        "prometheus",
        "grafana",
    }


def test_every_service_has_a_healthcheck_or_is_a_one_shot(everything: dict[str, Any]) -> None:
    for name, service in everything.items():
        if one_shot(service):
            assert service.get("restart") == "no", name
            assert not service.get("ports"), f"{name}: a one-shot publishes nothing"
            continue
        check = service.get("healthcheck") or {}
        assert check.get("test") and check["test"][0] in {"CMD", "CMD-SHELL"}, f"{name} has no healthcheck"
        assert not check.get("disable"), name
        assert service.get("restart") == "unless-stopped", name


def test_startup_order_waits_for_health(everything: dict[str, Any]) -> None:
    depended_on_one_shots = set()
    for name, service in everything.items():
        for dep, spec in (service.get("depends_on") or {}).items():
            assert dep in everything, f"{name} depends on unknown {dep}"
            expected = "service_completed_successfully" if one_shot(everything[dep]) else "service_healthy"
            assert spec["condition"] == expected, f"{name} -> {dep}"
            if one_shot(everything[dep]):
                depended_on_one_shots.add(dep)
    # every init job gates something
    assert depended_on_one_shots == {n for n, s in everything.items() if one_shot(s)}
    dispatcher = everything["dispatcher"]["depends_on"]
    assert set(dispatcher) == {"kafka-init", "redis", "minio-init", "ray-head"}
    assert set(everything["api"]["depends_on"]) == {"kafka-init", "redis", "minio-init"}
    assert set(everything["ray-worker-cpu"]["depends_on"]) == {"ray-head", "model-init-cpu"}
    assert set(everything["ray-worker-gpu"]["depends_on"]) == {"ray-head", "model-init-gpu"}


def test_dispatcher_environment_names_are_settings(projects: dict[tuple[str, ...], dict[str, Any]]) -> None:
    names = vd.settings_env_names()
    env = projects[()]["services"]["dispatcher"]["environment"]
    assert len(env) >= 10
    assert set(env) - names == set(), "not settings names"
    example = {k for k in env_example() if k.startswith("LLMBATCH_")}
    assert example - names == set(), ".env.example names that are not settings"


def test_the_api_runs_the_image_cli_with_settings_names_and_a_valid_key_map(
    projects: dict[tuple[str, ...], dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmbatch.api.settings import ApiSettings

    api = projects[()]["services"]["api"]
    assert api["command"][0] == "api" and api["image"] == projects[()]["services"]["dispatcher"]["image"]
    env = api["environment"]
    assert set(env) - vd.settings_env_names(ApiSettings) == set(), "not settings names"
    # the example key map is what the API reads: every key a SHA-256 hash
    monkeypatch.setenv("LLMBATCH_API__KEYS", env["LLMBATCH_API__KEYS"])
    settings = ApiSettings(_env_file=None)
    assert settings.api.keys and all(len(h) == 64 for h in settings.api.keys)


def test_ray_containers_use_settings_names(everything: dict[str, Any]) -> None:
    from llmbatch.api.settings import ApiSettings

    for name, service in everything.items():
        names = vd.settings_env_names(ApiSettings if name == "api" else None)
        for key in service.get("environment") or {}:
            if key.startswith("LLMBATCH_"):
                assert key in names, f"{name}: {key}"


def test_dispatcher_settings_point_at_the_compose_services(
    projects: dict[tuple[str, ...], dict[str, Any]],
) -> None:
    for profiles in (("cpu",), ("gpu",)):
        project = projects[profiles]
        services = project["services"]
        env = {k: v for k, v in env_example().items() if k.startswith("LLMBATCH_")}
        env.update(services["dispatcher"]["environment"])  # `environment` wins over env_file
        settings = vd.build_settings(env)
        host, _, port = settings.kafka.bootstrap_servers.partition(":")
        assert host == "kafka"
        assert f"INTERNAL://kafka:{port}" in services["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"]
        assert urlparse(settings.redis.url).hostname == "redis"
        assert urlparse(settings.s3.endpoint).hostname == "minio"
        ray = urlparse(settings.ray.address)
        assert (
            ray.hostname == "ray-head" and f"--dashboard-port={ray.port}" in services["ray-head"]["command"]
        )
        if settings.dispatcher.shared_engines and settings.dispatcher.short_path_max_lines > 0:
            # the batch runner behind Serve's proxy on the head (loopback would be the dispatcher's own)
            assert urlparse(settings.ray.serve_address).hostname == "ray-head"
        assert settings.ray.auth_token is not None
        assert (
            settings.ray.auth_token.get_secret_value()
            == services["ray-head"]["environment"]["RAY_AUTH_TOKEN"]
        )
        assert services["ray-head"]["environment"]["RAY_AUTH_MODE"] == "token"
        assert services["ray-head"]["environment"]["RAY_process_group_cleanup_enabled"] == "1"
        assert settings.redis.password.get_secret_value() == env_example()["REDIS_PASSWORD"]
        assert (
            settings.s3.access_key.get_secret_value() == services["minio"]["environment"]["MINIO_ROOT_USER"]
        )
        assert settings.dispatcher.metrics_host == "0.0.0.0"
        published = {p["target"] for p in services["dispatcher"]["ports"]}
        assert published == {settings.dispatcher.metrics_port}
        assert f":{settings.dispatcher.metrics_port}/readyz" in " ".join(
            services["dispatcher"]["healthcheck"]["test"]
        )
        # the buckets minio-init creates are the ones the settings name
        buckets = services["minio-init"]["environment"]["BUCKETS"].split()
        assert {settings.s3.input_bucket, settings.s3.results_bucket} <= set(buckets)
        topics = services["kafka-init"]["environment"]
        assert [topics["REQUESTS"], topics["RESULTS"], topics["DEAD_LETTER"]] == [
            settings.kafka.topics.requests,
            settings.kafka.topics.results,
            settings.kafka.topics.dead_letter,
        ]
        # the model the jobs load is what model-init puts on the volume the workers mount
        worker = services[f"ray-worker-{profiles[0]}"]
        init = services[f"model-init-{profiles[0]}"]
        dest = init["command"][init["command"].index("--dest") + 1]
        ((name, entry),) = settings.engines.models.items()  # the one model MODEL_NAME/MODEL_PATH name
        assert name == env_example()["MODEL_NAME"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
        assert entry.engine.enforce_eager is True
        assert entry.path == dest or profiles == ("gpu",)
        mounts = [v for v in worker["volumes"] if entry.path.startswith(v["target"] + "/")]
        assert mounts and mounts[0]["read_only"] and mounts[0]["source"] == "models"
        assert settings.job.pass_s3_credentials is False
        assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "LLMBATCH_S3__ENDPOINT"} <= set(
            worker["environment"]
        )


def test_gpu_profile_model_path_matches_its_model_init(
    projects: dict[tuple[str, ...], dict[str, Any]],
) -> None:
    """In the gpu profile the user sets MODEL_NAME/MODEL_PATH/MODEL_ENGINE; model-init-gpu fills the same
    folder the dispatcher's one registry entry points at."""
    gpu_env = {
        **env_example(),
        "MODEL_NAME": "Qwen/Qwen2.5-0.5B-Instruct",
        "MODEL_PATH": "/models/Qwen2.5-0.5B-Instruct",
        "MODEL_ENGINE": '{"num_gpus_per_replica": 1, "enforce_eager": false}',
    }
    with_path = _compose_with_env(gpu_env, ("gpu",))
    init = with_path["services"]["model-init-gpu"]["command"]
    assert init[init.index("--dest") + 1] == "/models/Qwen2.5-0.5B-Instruct"
    env = {k: v for k, v in gpu_env.items() if k.startswith("LLMBATCH_")}
    env.update(with_path["services"]["dispatcher"]["environment"])
    entry = vd.build_settings(env).engines.get("Qwen/Qwen2.5-0.5B-Instruct")
    assert entry.path == init[init.index("--dest") + 1]
    assert entry.engine.num_gpus_per_replica == 1 and entry.engine.enforce_eager is False


def _compose_with_env(env: dict[str, str], profiles: tuple[str, ...]) -> dict[str, Any]:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".env") as handle:
        handle.write("".join(f"{k}={v}\n" for k, v in env.items()))
        handle.flush()
        project: dict[str, Any] = vd.compose_config(profiles, env_file=Path(handle.name))
        return project


def test_secrets_are_required_not_defaulted() -> None:
    """Without a .env the stack refuses to start instead of running with known passwords."""
    env = {k: v for k, v in env_example().items() if k != "REDIS_PASSWORD"}
    with pytest.raises(vd.DeployCheckError, match="REDIS_PASSWORD"):
        _compose_with_env(env, ())


def test_interpolated_variables_are_all_in_env_example() -> None:
    text = vd.COMPOSE_FILE.read_text()
    used = set(re.findall(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)", text))
    example = env_example()
    assert used - set(example) == set(), "add these to .env.example"
    unused = {k for k in example if k not in used and not k.startswith("LLMBATCH_")}
    assert unused == set(), ".env.example variables nothing reads"


def test_published_ports_do_not_collide_and_stay_local(
    projects: dict[tuple[str, ...], dict[str, Any]],
) -> None:
    for profiles, project in projects.items():
        seen: dict[str, str] = {}
        for name, service in project["services"].items():
            for port in service.get("ports") or []:
                assert port["host_ip"] == "127.0.0.1", f"{name} publishes on all interfaces"
                key = f"{port['published']}/{port.get('protocol', 'tcp')}"
                assert key not in seen, f"{profiles}: {name} and {seen.get(key)} both publish {key}"
                seen[key] = name


def test_volumes(everything: dict[str, Any], projects: dict[tuple[str, ...], dict[str, Any]]) -> None:
    declared = set(projects[("cpu", "monitoring")]["volumes"])
    used: set[str] = set()
    writers: dict[str, list[str]] = {}
    for name, service in everything.items():
        for volume in service.get("volumes") or []:
            if volume["type"] == "volume":
                used.add(volume["source"])
                if not volume.get("read_only") and not one_shot(service):
                    writers.setdefault(volume["source"], []).append(name)
            elif volume["type"] == "bind":
                assert Path(volume["source"]).exists(), f"{name}: {volume['source']} does not exist"
                assert volume.get("read_only"), f"{name}: bind mounts are read-only"
    assert used == declared, "declared vs used named volumes"
    for volume, names in writers.items():
        # several writers only when no two of them run together (cpu vs gpu profile)
        for a, b in combinations(names, 2):
            assert not any({a, b} <= set(p["services"]) for p in projects.values()), f"{volume}: {a} and {b}"
    for name in ("kafka", "redis", "minio"):
        assert any(v["type"] == "volume" for v in everything[name]["volumes"]), (
            f"{name} keeps data in a volume"
        )


def test_images_are_pinned_or_built_here(everything: dict[str, Any]) -> None:
    for name, service in everything.items():
        image = service["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest" and re.search(r"\d", tag), f"{name}: {image}"
        if "build" in service:
            build = service["build"]
            dockerfile = Path(build["context"]) / build["dockerfile"]
            assert dockerfile.exists(), dockerfile
            stages = {s.name for s in dockerfiles.parse_dockerfile(dockerfile).stages}
            assert build.get("target") in stages | {None}, f"{name}: target {build.get('target')}"
            assert tag.endswith(build["target"]) if build.get("target") else True, (
                f"{name}: tag says the target"
            )
    assert everything["kafka"]["image"] == "apache/kafka:4.2.0"
    assert everything["redis"]["image"].startswith("redis:7.")
    assert re.fullmatch(r"minio/minio:RELEASE\.\d{4}-\d\d-\d\dT\d\d-\d\d-\d\dZ", everything["minio"]["image"])


def test_stores_are_configured_for_durability(everything: dict[str, Any]) -> None:
    redis = everything["redis"]["command"]
    assert redis[redis.index("--appendonly") + 1] == "yes"
    kafka = everything["kafka"]["environment"]
    assert set(kafka["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}  # KRaft, no ZooKeeper
    assert not any("ZOOKEEPER" in k for k in kafka)
    assert kafka["KAFKA_LOG_DIRS"] in {v["target"] for v in everything["kafka"]["volumes"]}


def test_gpu_worker_reserves_a_gpu(everything: dict[str, Any]) -> None:
    devices = everything["ray-worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    assert "deploy" not in everything["ray-worker-cpu"]
    count = str(devices[0]["count"])
    assert f"--num-gpus={count}" in everything["ray-worker-gpu"]["command"]


def test_commands_parse(everything: dict[str, Any]) -> None:
    from ray.scripts.scripts import start

    import llmbatch.cli

    fetch_model = load_file("fetch_model", vd.DEPLOY / "docker" / "fetch_model.py")
    checked = set()
    for name, service in everything.items():
        command = service.get("command") or []
        if command[:2] == ["ray", "start"]:
            start.make_context("start", list(command[2:]))
            checked.add(name)
        elif len(command) > 1 and command[1].endswith("fetch_model.py"):
            fetch_model.build_parser().parse_args(command[2:])
            checked.add(name)
    assert checked == {"ray-head", "ray-worker-cpu", "ray-worker-gpu", "model-init-cpu", "model-init-gpu"}
    # the dispatcher's command is a real `llmbatch` subcommand (the image's ENTRYPOINT is `llmbatch`)
    import typer.main
    from typer.core import TyperGroup

    group = typer.main.get_command(llmbatch.cli.app)
    assert isinstance(group, TyperGroup)
    command = everything["dispatcher"]["command"]
    ctx = group.make_context("llmbatch", list(command), resilient_parsing=True)
    sub = group.get_command(ctx, command[0])
    assert isinstance(sub, TyperGroup) and sub.get_command(ctx, command[1]) is not None


def test_compose_loader_rejects_invalid_files(tmp_path: Path) -> None:
    bad = tmp_path / "compose.yml"
    bad.write_text("services:\n  x:\n    image: redis:7.4.2\n    healthcheck:\n      tset: [CMD, 'true']\n")
    with pytest.raises(vd.DeployCheckError, match="tset"):
        vd.compose_config((), env_file=vd.ENV_EXAMPLE, compose_file=bad)


def test_monitoring_provisioning(everything: dict[str, Any]) -> None:
    prometheus = vd.load_yaml((vd.DEPLOY / "compose" / "prometheus.yml").read_text())
    targets = {
        t for job in prometheus["scrape_configs"] for c in job.get("static_configs", []) for t in c["targets"]
    }
    assert "dispatcher:9464" in targets and "ray-head:8080" in targets
    grafana_mounts = {
        v["target"]: v["source"] for v in everything["grafana"]["volumes"] if v["type"] == "bind"
    }
    dashboards = [Path(s) for t, s in grafana_mounts.items() if t.endswith(".json")]
    assert [d.resolve() for d in dashboards] == [grafana.DASHBOARD.resolve()]
    provider = vd.load_yaml((vd.DEPLOY / "compose/grafana/provisioning/dashboards/llmbatch.yaml").read_text())
    folder = provider["providers"][0]["options"]["path"]
    assert any(t.startswith(folder + "/") for t in grafana_mounts)
