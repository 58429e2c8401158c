"""How a batch's call to its shared engine names what went wrong (issue: outages do not spend attempts):
Serve itself failing is an outage (exit 75, not counted), a model that is not deployed is
``engine_unavailable`` (fails once), a dead engine is told by its exception's type, never by its text.
The handle is a stand-in with Ray's own exception classes; the real faults run in
tests/integration/test_serve_engine_vllm_faults.py and the chaos suite."""

from __future__ import annotations

from typing import Any, cast

import pytest
from ray import exceptions as ray_exceptions
from ray.serve._private.common import DeploymentID
from ray.serve.exceptions import DeploymentUnavailableError, RayServeException
from ray.serve.handle import DeploymentHandle

from llmbatch.ray_job.engines.serve_client import ServeEngine
from llmbatch.ray_job.errors import EngineDeadError, EngineUnavailableError, ExitCode, InfraUnavailableError
from llmbatch.ray_job.storage import s3_session
from llmbatch.schemas.engines import DEPLOYMENT_NAME

DEPLOYMENT = DeploymentID(name=DEPLOYMENT_NAME, app_name="llmbatch-engine-m")


class _Response:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def result(self, timeout_s: float) -> Any:
        raise self.error


class _Method:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def remote(self, *args: Any) -> _Response:
        return _Response(self.error)


class _Handle:
    def __init__(self, error: BaseException) -> None:
        self.info = self.generate = _Method(error)


class _Engine(ServeEngine):
    """The engine's client with Serve's status given (None: Serve does not answer)."""

    def __init__(self, error: BaseException, app_state: str | None = "RUNNING") -> None:
        # no Serve: the handle stands in for one
        self.app, self._wait_s, self._retries = "llmbatch-engine-m", 5.0, 0
        self._handle = cast(DeploymentHandle[Any], _Handle(error))  # has the calls the engine makes
        self.state = app_state

    def _app_state(self) -> str | None:
        return self.state


def _engine(error: BaseException, app_state: str | None = "RUNNING") -> ServeEngine:
    return _Engine(error, app_state)


@pytest.mark.parametrize("app_state", ["RUNNING", "DEPLOYING", None])
@pytest.mark.parametrize(
    "error", [DeploymentUnavailableError(DEPLOYMENT), RayServeException("controller away")]
)
def test_serve_failing_is_an_outage_not_the_batchs_fault(error: BaseException, app_state: str | None) -> None:
    with pytest.raises(InfraUnavailableError) as raised:
        _engine(error, app_state).wait_ready()
    assert raised.value.exit_code == ExitCode.INFRA_UNAVAILABLE


@pytest.mark.parametrize("app_state", ["DEPLOY_FAILED", "UNHEALTHY", ""])
def test_an_engine_that_cannot_start_is_engine_unavailable(app_state: str) -> None:
    with pytest.raises(EngineUnavailableError):
        _engine(DeploymentUnavailableError(DEPLOYMENT), app_state).wait_ready()


def test_a_model_that_is_not_deployed_is_engine_unavailable() -> None:
    with pytest.raises(EngineUnavailableError) as raised:
        _engine(KeyError("llmbatch-engine-m")).wait_ready()
    assert raised.value.exit_code == ExitCode.ENGINE_UNAVAILABLE


def test_a_dead_engine_is_told_by_type_not_by_text() -> None:
    dead = ray_exceptions.RayTaskError(  # type: ignore[no-untyped-call]  # Ray does not annotate it
        "generate", "tb", EngineDeadError("gone")
    ).as_instanceof_cause()
    with pytest.raises(EngineDeadError):
        _engine(dead).wait_ready()
    # a task error whose text mentions the name but whose cause is another error stays what it is
    other = ray_exceptions.RayTaskError(  # type: ignore[no-untyped-call]  # Ray does not annotate it
        "generate", "EngineDeadError in a log line", ValueError("x")
    )
    with pytest.raises(ray_exceptions.RayTaskError) as raised:
        _engine(other.as_instanceof_cause()).wait_ready()  # type: ignore[no-untyped-call]  # as above
    assert not isinstance(raised.value, EngineDeadError)


def test_redis_not_answering_for_the_session_is_an_outage() -> None:
    with pytest.raises(s3_session.SessionUnavailableError) as raised:
        s3_session.fetch("redis://127.0.0.1:1/0", "p:s3session:n1", timeout_s=1)
    assert raised.value.exit_code == ExitCode.INFRA_UNAVAILABLE
