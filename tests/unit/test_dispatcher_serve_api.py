"""The Serve REST client against a real local HTTP server that answers as the dashboard would (or
would not): what each answer becomes, and how long a deploy may take."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from llmbatch.dispatcher.backends.serve_api import PATH, ServeApi
from llmbatch.dispatcher.errors import PermanentError, RayUnavailable
from llmbatch.stack.ports import free_port
from tests.support.scripted_http import ScriptedHttpServer

pytestmark = pytest.mark.unit


def test_status_is_the_dashboards_json_and_deploy_puts_the_config(dashboard: ScriptedHttpServer) -> None:
    details = {"applications": {"a": {"status": "RUNNING"}}, "controller_info": {"actor_id": "c1"}}
    dashboard.answers[("GET", PATH)] = (200, orjson.dumps(details))
    api = ServeApi(dashboard.address, timeout_s=5)
    config = {"applications": [{"name": "a", "import_path": "m:app"}]}

    asyncio.run(api.deploy(config))

    assert asyncio.run(api.status()) == details
    put = next(s for s in dashboard.seen if s.method == "PUT")
    assert put.path == PATH and orjson.loads(put.body) == config
    assert put.headers["Content-Type"] == "application/json"


def test_a_first_deploy_may_take_longer_than_a_read(dashboard: ScriptedHttpServer) -> None:
    # the first PUT starts Serve's controller and proxies before it answers; reads stay short
    dashboard.delays[("PUT", PATH)] = dashboard.delays[("GET", PATH)] = 1.5
    api = ServeApi(dashboard.address, timeout_s=0.5, deploy_timeout_s=10)

    asyncio.run(api.deploy({"applications": []}))

    with pytest.raises(RayUnavailable, match="did not answer"):
        asyncio.run(api.status())


def test_a_deploy_that_outlasts_its_timeout_is_an_outage_to_retry(dashboard: ScriptedHttpServer) -> None:
    dashboard.delays[("PUT", PATH)] = 2.0
    with pytest.raises(RayUnavailable, match="did not answer") as caught:
        asyncio.run(ServeApi(dashboard.address, timeout_s=0.2, deploy_timeout_s=0.5).deploy({}))
    assert caught.value.retriable


def test_the_deploy_timeout_is_never_shorter_than_the_read_timeout() -> None:
    assert ServeApi("http://127.0.0.1:1", timeout_s=60, deploy_timeout_s=5).deploy_timeout_s == 60


@pytest.mark.parametrize("code", [500, 502, 503, 429])
def test_a_server_error_is_retriable(dashboard: ScriptedHttpServer, code: int) -> None:
    dashboard.answers[("PUT", PATH)] = (code, b"controller not ready")
    with pytest.raises(RayUnavailable, match=f"answered {code}: controller not ready") as caught:
        asyncio.run(ServeApi(dashboard.address, timeout_s=5).deploy({}))
    assert caught.value.retriable


@pytest.mark.parametrize("code", [401, 403])
def test_refused_credentials_name_the_token_setting(dashboard: ScriptedHttpServer, code: int) -> None:
    dashboard.answers[("GET", PATH)] = (code, b"no")
    with pytest.raises(RayUnavailable, match="LLMBATCH_RAY__AUTH_TOKEN"):
        asyncio.run(ServeApi(dashboard.address, timeout_s=5).status())


def test_a_refused_config_is_permanent_and_says_why(dashboard: ScriptedHttpServer) -> None:
    dashboard.answers[("PUT", PATH)] = (400, b"import_path is required")
    refused = "refused the config \\(400\\): import_path is required"
    with pytest.raises(PermanentError, match=refused) as caught:
        asyncio.run(ServeApi(dashboard.address, timeout_s=5).deploy({}))
    assert not caught.value.retriable


def test_an_answer_that_is_not_json_is_an_outage_not_a_crash(dashboard: ScriptedHttpServer) -> None:
    # a proxy's error page in front of the dashboard, or a dashboard still starting
    dashboard.answers[("GET", PATH)] = (200, b"<html>502 Bad Gateway</html>")
    with pytest.raises(RayUnavailable, match="not JSON"):
        asyncio.run(ServeApi(dashboard.address, timeout_s=5).status())


def test_a_status_that_is_not_an_object_reads_as_no_details(dashboard: ScriptedHttpServer) -> None:
    dashboard.answers[("GET", PATH)] = (200, b"[]")
    assert asyncio.run(ServeApi(dashboard.address, timeout_s=5).status()) == {}


def test_nothing_listening_is_an_outage() -> None:
    with pytest.raises(RayUnavailable, match="did not answer"):
        asyncio.run(ServeApi(f"http://127.0.0.1:{free_port()}", timeout_s=2).status())
