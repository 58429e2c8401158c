"""ray_job.storage.s3: which S3 errors are answers about the object (missing, forbidden) and which are an
outage to retry. The messages are pyarrow's own, as seen from MinIO (tests/integration/
test_tenant_pools.py reads a forbidden input through a tenant's keys on a real server)."""

from __future__ import annotations

import pytest

from llmbatch.ray_job.storage.s3 import is_refusal, path_of, s3_error_code, uri_of

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "refused"),
    [
        (
            "When getting information for key 'globex/x.jsonl' in bucket 'in': AWS Error ACCESS_DENIED "
            "during HeadObject operation: No response body.",
            True,
        ),
        ("When getting information for bucket 'nope': AWS Error NO_SUCH_BUCKET during HeadBucket", True),
        ("AWS Error [code 15]: AccessDenied", True),
        (FileNotFoundError("Path does not exist 'in/x'"), True),
        (
            "When getting information for key 'x' in bucket 'in': AWS Error NETWORK_CONNECTION during "
            "HeadObject operation: curlCode: 7, Couldn't connect to server",
            False,
        ),
        ("AWS Error SLOW_DOWN during GetObject operation", False),
    ],
)
def test_a_forbidden_or_missing_object_is_an_answer_an_outage_is_not(
    text: str | OSError, refused: bool
) -> None:
    assert is_refusal(text) is refused


@pytest.mark.parametrize(
    "key",
    [
        "acme/403/x.jsonl",  # about 1.5 % of sha256 names hold "403": they were "refused" before
        "acme/Forbidden-does not exist.jsonl",
        "acme/AWS Error ACCESS_DENIED during HeadObject operation.jsonl",
    ],
)
def test_the_objects_own_name_is_never_read_as_its_error(key: str) -> None:
    text = (
        f"When getting information for key '{key}' in bucket 'in': AWS Error NETWORK_CONNECTION during "
        "HeadObject operation: curlCode: 7, Couldn't connect to server"
    )
    assert s3_error_code(text, f"in/{key}", "in", key) == "NETWORK_CONNECTION"
    assert is_refusal(text, f"in/{key}", "in", key) is False


def test_uris_and_paths_round_trip() -> None:
    assert path_of("s3://in/acme/x.jsonl") == "in/acme/x.jsonl"
    assert uri_of("in/acme/x.jsonl") == "s3://in/acme/x.jsonl"
    with pytest.raises(ValueError, match="not an s3:// URI"):
        path_of("http://in/x")


def test_an_s3_that_does_not_answer_is_an_outage_not_a_missing_input() -> None:
    """Real pyarrow against a port nobody listens on: before, the key's "403" made this a refusal,
    and the batch failed input_not_found for good (exit 66) instead of being retried (exit 75)."""
    from pyarrow import fs as pafs

    from llmbatch.ray_job.errors import ExitCode, InfraUnavailableError
    from llmbatch.ray_job.storage.s3 import check_readable
    from llmbatch.stack.ports import free_port

    nobody = pafs.S3FileSystem(
        endpoint_override=f"127.0.0.1:{free_port()}",
        scheme="http",
        access_key="a",
        secret_key="b",
        region="us-east-1",
        connect_timeout=1,
        request_timeout=2,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1),
    )
    with pytest.raises(InfraUnavailableError) as raised:
        check_readable(nobody, "in/acme/403/x.jsonl")
    assert raised.value.exit_code is ExitCode.INFRA_UNAVAILABLE and "NETWORK_CONNECTION" in str(raised.value)
