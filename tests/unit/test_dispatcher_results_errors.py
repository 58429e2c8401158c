"""dispatcher.results: how a failed minio call is told apart (the same exception types minio raises)."""

from __future__ import annotations

import pytest
import urllib3
from minio.error import InvalidResponseError, S3Error, ServerError

from llmbatch.dispatcher.errors import PermanentError, StorageUnavailable
from llmbatch.dispatcher.runs.results import ResultStore
from llmbatch.settings import S3Settings

pytestmark = pytest.mark.unit
ENDPOINT = "http://minio.test:9000"


def s3_error(code: str, status: int) -> S3Error:
    return S3Error(
        urllib3.HTTPResponse(status=status),
        code,
        f"{code} happened",
        "/b/k",
        "req",
        "host",
        bucket_name="b",
        object_name="k",
    )


async def failing(exc: Exception) -> Exception:
    def call() -> None:
        raise exc

    try:
        await ResultStore(S3Settings(endpoint=ENDPOINT))._run(call)
    except Exception as translated:  # what it was translated into is the point
        return translated
    raise AssertionError("the call did not fail")


@pytest.mark.parametrize("code", ["NoSuchKey", "NoSuchBucket"])
async def test_missing_is_not_an_error(code: str) -> None:
    assert isinstance(await failing(s3_error(code, 404)), FileNotFoundError)


@pytest.mark.parametrize("code", ["AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"])
async def test_refused_keys_wait_and_say_which_settings(code: str) -> None:
    error = await failing(s3_error(code, 403))
    assert isinstance(error, StorageUnavailable) and error.retriable
    assert code in str(error) and "LLMBATCH_S3__SECRET_KEY" in str(error) and ENDPOINT in str(error)


@pytest.mark.parametrize(
    "exc",
    [
        s3_error("InvalidArgument", 400),
        s3_error("MethodNotAllowed", 405),
        InvalidResponseError(400, "text/html", "<html>bad request</html>"),
    ],
)
async def test_other_client_errors_are_permanent(exc: Exception) -> None:
    error = await failing(exc)
    assert isinstance(error, PermanentError) and not error.retriable


@pytest.mark.parametrize(
    "exc",
    [
        s3_error("SlowDown", 503),
        s3_error("RequestTimeout", 408),
        ServerError("internal error", 500),
        urllib3.exceptions.MaxRetryError(
            urllib3.HTTPConnectionPool("minio.test", 9000),
            "/b/k",
            ConnectionRefusedError("connection refused"),
        ),
    ],
)
async def test_server_trouble_is_an_outage(exc: Exception) -> None:
    error = await failing(exc)
    assert isinstance(error, StorageUnavailable) and error.retriable


@pytest.mark.parametrize(
    ("code", "status"),
    [("RequestTimeTooSkewed", 403), ("RequestTimeout", 400), ("SlowDown", 503), ("ExpiredToken", 400)],
)
async def test_a_skewed_clock_and_kin_are_outages_not_a_batchs_fault(code: str, status: int) -> None:
    """Before, RequestTimeTooSkewed (403) was a PermanentError: a finalizing batch was stuck for good."""
    error = await failing(s3_error(code, status))
    assert isinstance(error, StorageUnavailable) and error.retriable and code in str(error)


async def test_a_skewed_clock_says_what_to_fix() -> None:
    assert "NTP" in str(await failing(s3_error("RequestTimeTooSkewed", 403)))
