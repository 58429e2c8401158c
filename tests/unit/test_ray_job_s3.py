"""ray_job.s3: which S3 errors are answers about the object (missing, forbidden) and which are an
outage to retry. The messages are pyarrow's own, as seen from MinIO (tests/integration/
test_tenant_pools.py reads a forbidden input through a tenant's keys on a real server)."""

from __future__ import annotations

import pytest

from llmbatch.ray_job.s3 import is_refusal, path_of, uri_of

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
        ("Path does not exist 'in/x'", True),
        (
            "When getting information for key 'x' in bucket 'in': AWS Error NETWORK_CONNECTION during "
            "HeadObject operation: curlCode: 7, Couldn't connect to server",
            False,
        ),
        ("AWS Error SLOW_DOWN during GetObject operation", False),
    ],
)
def test_a_forbidden_or_missing_object_is_an_answer_an_outage_is_not(text: str, refused: bool) -> None:
    assert is_refusal(text) is refused


def test_uris_and_paths_round_trip() -> None:
    assert path_of("s3://in/acme/x.jsonl") == "in/acme/x.jsonl"
    assert uri_of("in/acme/x.jsonl") == "s3://in/acme/x.jsonl"
    with pytest.raises(ValueError, match="not an s3:// URI"):
        path_of("http://in/x")
