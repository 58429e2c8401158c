"""Every hop over TLS, as ``llmbatch stack up --tls`` starts the local stack: Kafka SASL_SSL
(SCRAM-SHA-512), Redis TLS only (``rediss://``) and MinIO over https only, each presenting a
certificate of a CA made at test time, and a Ray head whose jobs and replicas find the S3 keys in their
own environment and the CA bundles' paths in what the dispatcher sends them. Two batches run with every
hop encrypted: a small one on the warm batch runner (Serve), one from an input file as a Ray job on the
shared engine; each writes its state, progress and results over TLS, and the servers refuse plaintext.
Ray's own gRPC (GCS, raylet, workers: the job's driver, the replicas) is TLS too; the dispatcher reaches
its dashboard (Jobs and Serve APIs) through the TLS front the stack puts before it, and Serve's HTTP proxy
(the batch runner) speaks TLS itself, with the certificate the dispatcher's Serve config names."""

from __future__ import annotations

import asyncio
import io
import ssl
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import orjson
import pytest

from llmbatch.adapters.storage import ensure_buckets, make_client
from llmbatch.adapters.topics import ensure_topics
from llmbatch.dispatcher.domain.keys import batch_key
from llmbatch.schemas.engines import EngineRegistry, ReplicaResources, Scaling
from llmbatch.schemas.events import EventType
from llmbatch.stack import manager
from llmbatch.stack.process import StackError
from tests.e2e.test_dispatcher_e2e import Env, world
from tests.support.dispatcher_kit import MODEL, batch_request, inline_lines, request_message

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


async def test_batches_run_with_every_hop_encrypted_and_plaintext_is_refused(tmp_path: Path) -> None:
    from llmbatch.dispatcher.backends.serve_api import ServeApi

    run = tmp_path / "stack"
    try:
        # what `llmbatch stack up --tls` does: a CA for the run folder, TLS-only Kafka, Redis and MinIO
        state = await asyncio.to_thread(manager.up, run, tls=True)
        stack = manager.settings_for(state)
        assert stack.kafka.security_protocol == "SASL_SSL" and stack.kafka.ssl_cafile is not None
        assert stack.redis.url.startswith("rediss://") and stack.redis.ssl_ca_certs is not None
        assert stack.s3.endpoint.startswith("https://") and stack.s3.ca_file is not None
        assert stack.ray.address.startswith("https://") and stack.ray.serve_address.startswith("https://")
        assert stack.ray.ca_file is not None and stack.ray.serve_ssl_certfile is not None
        ensure_buckets(make_client(stack.s3), stack.s3)
        settings = world(
            stack.kafka,
            stack.redis,
            stack.s3,
            stack.ray,
            shared_engines=True,
            max_in_flight=None,
            short_path_max_bytes=64,
        )
        entry = settings.engines.get(MODEL).model_copy(
            update={
                "resources": ReplicaResources(num_cpus=0.25),
                "scaling": Scaling(min_replicas=1, max_replicas=1, idle_s=60),
            }
        )
        settings = settings.model_copy(update={"engines": EngineRegistry(models={MODEL: entry})})
        await ensure_topics(settings)
        e = Env(settings, tmp_path)
        e.spawn()
        try:
            small = batch_request(f"tls-inline-{uuid.uuid4().hex[:6]}", requests=inline_lines(2))
            key = f"default/tls-{uuid.uuid4().hex[:6]}.jsonl"
            body = b"".join(orjson.dumps(line) + b"\n" for line in inline_lines(6, prefix="file"))
            client = make_client(stack.s3)
            await asyncio.to_thread(
                client.put_object, stack.s3.input_bucket, key, io.BytesIO(body), len(body)
            )
            big = batch_request(
                f"tls-file-{uuid.uuid4().hex[:6]}", input_uri=f"s3://{stack.s3.input_bucket}/{key}"
            )
            await e.send(request_message(small), request_message(big))
            found = await e.wait_terminal([small.batch_id, big.batch_id], within=600)
            for request, lines in ((small, 2), (big, 6)):
                [event] = found[request.batch_id]
                assert event.type is EventType.COMPLETED, event.data
                counts = event.data.request_counts
                assert (counts.total, counts.completed) == (lines, lines), counts
                outputs = []
                for uri in event.data.output_uris:
                    bucket, _, name = str(uri).removeprefix("s3://").partition("/")
                    outputs += client.get_object(bucket, name).read().splitlines()
                assert len(outputs) == lines
            records = {b.batch_id: await e.store.get(batch_key(None, b.batch_id)) for b in (small, big)}
            vias = {b: r.get("via") if r is not None else None for b, r in records.items()}
            assert vias[small.batch_id] == "batch_runner" and vias[big.batch_id] != "batch_runner", vias
            # Ray's HTTP hops: the dashboard's front and Serve's proxy take TLS only
            ray = stack.ray
            for url in (ray.address + "/api/jobs/", ray.serve_address + "/llmbatch-runner/engines"):
                await asyncio.to_thread(_http_refused, url)
        finally:
            await e.close()
            await ServeApi.of(stack.ray, timeout_s=30).deploy({"applications": []})

        # the servers speak TLS only: plaintext clients get nowhere
        services = state.services
        await _refused_plaintext(
            services["kafka"].address, services["redis"].ports["redis"], services["minio"].address
        )
        _ray_grpc_is_tls_only(services["ray"].ports["gcs"], run / "tls")
        # and `stack up` without --tls will not reuse them as plaintext services
        with pytest.raises(StackError, match="running with TLS"):
            manager.up(run, ["redis"])
    finally:
        manager.down(run)


def _plaintext_refused(redis_port: int, minio_https: str) -> None:
    import redis

    plain_redis = redis.Redis(host="127.0.0.1", port=redis_port, socket_timeout=3)
    with pytest.raises(redis.ConnectionError):
        plain_redis.ping()
    plain_redis.close()

    with pytest.raises(urllib.error.HTTPError) as caught:  # Go's TLS server answers plain HTTP with 400
        urllib.request.urlopen(minio_https.replace("https://", "http://") + "/minio/health/ready", timeout=5)
    assert caught.value.code == 400
    with pytest.raises(urllib.error.URLError) as unverified:  # and https with the system's CAs fails
        urllib.request.urlopen(
            minio_https + "/minio/health/ready", timeout=5, context=ssl.create_default_context()
        )
    assert "CERTIFICATE_VERIFY_FAILED" in str(unverified.value)


def _http_refused(https_url: str) -> None:
    """Plain HTTP to ``https_url``'s port gets no answer, https without the CA fails verification."""
    import http.client

    with pytest.raises((http.client.RemoteDisconnected, ConnectionError, urllib.error.URLError)):
        urllib.request.urlopen(https_url.replace("https://", "http://"), timeout=5)
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(https_url, timeout=5, context=ssl.create_default_context())


def _ray_grpc_is_tls_only(gcs_port: int, tls_dir: Path) -> None:
    """Ray's GCS (and with it every raylet, worker, driver and replica, which call it) speaks TLS only:
    a plaintext gRPC client is refused, one with the CA and a certificate of it is answered."""
    import grpc  # type: ignore[import-untyped]  # no grpcio stubs (types-grpcio) in the dev environment
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    def nodes(channel: grpc.Channel) -> int:
        # Ray's generated gRPC code is unannotated, and protobuf makes its message classes at import time:
        # mypy sees neither
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)  # type: ignore[no-untyped-call]
        reply = stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), timeout=10)  # type: ignore[attr-defined]
        return len(reply.node_info_list)

    with grpc.insecure_channel(f"127.0.0.1:{gcs_port}") as plain, pytest.raises(grpc.RpcError):
        nodes(plain)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(tls_dir / "ca.pem").read_bytes(),
        private_key=(tls_dir / "server.key").read_bytes(),
        certificate_chain=(tls_dir / "server.pem").read_bytes(),
    )
    with grpc.secure_channel(f"127.0.0.1:{gcs_port}", credentials) as secure:
        assert nodes(secure) >= 1


async def _refused_plaintext(kafka_address: str, redis_port: int, minio_https: str) -> None:
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.errors import KafkaConnectionError

    await asyncio.to_thread(_plaintext_refused, redis_port, minio_https)
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_address, request_timeout_ms=3000)
    with pytest.raises((KafkaConnectionError, asyncio.TimeoutError, OSError)):
        await asyncio.wait_for(admin.start(), 10)
    await admin.close()
