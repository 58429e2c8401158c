"""LLMBATCH_DISPATCHER__REQUIRE_SIGNED_EVENTS: a production dispatcher refuses to start without the keys
that authenticate tenants and replays, instead of warning and trusting any producer."""

from __future__ import annotations

import json

import pytest
from pydantic import SecretStr
from typer.testing import CliRunner

from llmbatch.dispatcher.cli import app
from llmbatch.dispatcher.settings import DispatcherOptions, DispatcherSettings
from llmbatch.settings import ReplaySettings, TenantSettings
from tests.support.dispatcher_kit import registry, registry_env

pytestmark = pytest.mark.unit

KEY = "k" * 32


def _settings(required: bool, *, tenants: bool, replay: bool) -> DispatcherSettings:
    return DispatcherSettings(
        _env_file=None,
        dispatcher=DispatcherOptions(require_signed_events=required),
        engines=registry(),
        tenants=TenantSettings(keys={"acme": SecretStr(KEY)} if tenants else {}),
        replay=ReplaySettings(key=SecretStr(KEY) if replay else None),
    )


@pytest.mark.parametrize(
    ("tenants", "replay", "missing"),
    [
        (False, False, "LLMBATCH_TENANTS__KEYS and LLMBATCH_REPLAY__KEY are not set"),
        (False, True, "LLMBATCH_TENANTS__KEYS is not set"),
        (True, False, "LLMBATCH_REPLAY__KEY is not set"),
    ],
)
def test_required_keys_that_are_missing_are_named(tenants: bool, replay: bool, missing: str) -> None:
    problem = _settings(True, tenants=tenants, replay=replay).serving_problem()
    assert problem is not None
    assert problem.startswith(f"LLMBATCH_DISPATCHER__REQUIRE_SIGNED_EVENTS is on but {missing}")
    assert KEY not in problem


def test_with_both_keys_or_without_the_requirement_the_dispatcher_may_start() -> None:
    assert _settings(True, tenants=True, replay=True).serving_problem() is None
    assert _settings(False, tenants=False, replay=False).serving_problem() is None


def test_dispatcher_run_refuses_to_start_with_one_line_naming_the_missing_key(
    clean_env: pytest.MonkeyPatch,
) -> None:
    for name, value in registry_env().items():
        clean_env.setenv(name, value)
    clean_env.setenv("LLMBATCH_DISPATCHER__REQUIRE_SIGNED_EVENTS", "true")
    clean_env.setenv("LLMBATCH_TENANTS__KEYS", json.dumps({"acme": KEY}))
    result = CliRunner().invoke(app, ["run"])
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(
        "error: LLMBATCH_DISPATCHER__REQUIRE_SIGNED_EVENTS is on but LLMBATCH_REPLAY__KEY is not set"
    )
    assert KEY not in result.stderr
