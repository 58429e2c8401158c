"""A batch's view of a model's shared engine on Serve (:mod:`llmbatch.ray_job.engines.serve_engine`):
:class:`ServeEngine`, a client with the interface of a local engine, that waits for a replica, counts the
model's slots and turns Serve's failures into the batch's errors."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from llmbatch.ray_job.engines.engine_runner import STOP_POLL_S
from llmbatch.ray_job.errors import (
    ENGINE_ERROR,
    CallAbandonedError,
    EngineDeadError,
    EngineUnavailableError,
    InfraUnavailableError,
    JobError,
    RequestFailure,
)
from llmbatch.ray_job.lines.records import Generation, GenRequest
from llmbatch.schemas.batch import DEFAULT_PRIORITY
from llmbatch.schemas.engines import DEPLOYMENT_NAME

log = logging.getLogger(__name__)

REPLICAS_TTL_S = 10.0
BUILD_POLL_S = 1.0  # between looks for the deployment of an application Serve is still building


class ServeEngine:
    """A batch's view of the shared engine of one model: same calls as a local engine.

    ``wait_s`` bounds how long the batch waits for a replica (cold start from zero included)
    before it gets :class:`EngineUnavailableError`; generation calls then wait their turn in the
    replica's fair queue for as long as Serve reports the model's application running (a call
    behind higher-priority batches is waiting, not lost). A call whose replica dies is sent
    again (Serve routes it to a live or restarted replica) up to ``retries`` times; after that
    its requests become ``engine_error`` lines, so one bad replica never fails a batch.
    """

    def __init__(self, app: str, *, wait_s: float = 600.0, retries: int = 3) -> None:
        from ray import serve

        self.app = app
        self._wait_s = wait_s
        self._retries = retries
        from ray.serve.exceptions import RayServeException

        started = time.perf_counter()
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self._handle = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=app)
                break
            except KeyError as exc:
                # Serve builds an application after its config is applied: until then it is DEPLOYING
                # with no deployment (a batch launched right after the engines were deployed)
                if self._app_state() not in ("DEPLOYING", None) or time.monotonic() >= deadline:
                    raise self._unavailable(exc) from exc
                time.sleep(BUILD_POLL_S)
            except RayServeException as exc:  # no Serve instance (a head restarted), or a failed app
                raise self._serve_fault(exc) from exc
        info = self._call("info", timeout_s=max(deadline - time.monotonic(), BUILD_POLL_S))
        self.max_model_len: int = int(info["max_model_len"])
        self.default_max_tokens: int | None = info["default_max_tokens"]
        # requests one replica's engine runs at once (0 from a replica that does not say)
        self.max_active: int = int(info.get("max_active") or 0)
        self._replicas: tuple[float, int] | None = None  # (when counted, running replicas)
        # what this batch waited for an engine (a cold start when the model had scaled to zero)
        self.engine_start_s: float = time.perf_counter() - started
        self.ready_at: float = time.time()

    def slots(self) -> int:
        """Requests the model's live replicas run at once (``max_active_requests`` each): what a batch
        alone may keep at the engine (:func:`~llmbatch.schemas.engines.call_rows`). Replicas are
        counted from Serve's status at most every :data:`REPLICAS_TTL_S` (one when it does not say)."""
        now = time.monotonic()
        if self._replicas is None or now - self._replicas[0] > REPLICAS_TTL_S:
            self._replicas = (now, self._running_replicas())
        return self.max_active * self._replicas[1]

    def _running_replicas(self) -> int:
        from ray import serve

        try:
            app = serve.status().applications.get(self.app)
            states = app.deployments[DEPLOYMENT_NAME].replica_states if app is not None else {}
            # the states are ReplicaState members or (this Ray's REST-shaped status) plain strings
            running = sum(n for s, n in states.items() if str(getattr(s, "value", s)) == "RUNNING")
        except Exception as exc:  # the controller did not answer: the replica that did
            log.warning("no Serve status for %s: %s", self.app, exc)
            return 1
        return max(1, running)

    def wait_ready(self) -> None:
        """Wait (at most ``wait_s``) until a replica answers: a cached handle of a model that scaled
        to zero or was redeployed since meets a cold start here, not inside its first generation."""
        self._call("info", timeout_s=self._wait_s)

    def _unavailable(self, exc: BaseException) -> EngineUnavailableError:
        return EngineUnavailableError(f"the engine {self.app} is unavailable: {exc}"[:2000])

    def _app_state(self) -> str | None:
        """Serve's status of the model's application (``RUNNING``, ``DEPLOY_FAILED``, ...), ``""`` when
        Serve has no such application, None when Serve does not answer."""
        from ray import serve

        try:
            app = serve.status().applications.get(self.app)
        except Exception as exc:  # the controller did not answer
            log.warning("no Serve status for %s: %s", self.app, exc)
            return None
        return "" if app is None else str(getattr(app.status, "value", app.status))

    def _alive(self) -> bool:
        """Whether Serve reports the model's application running (or deploying)."""
        return self._app_state() in ("RUNNING", "DEPLOYING")

    def _serve_fault(self, exc: BaseException) -> JobError:
        """What Serve failing a call means for the batch: the model's engine cannot start (its
        application failed or is gone: fail once, ``engine_unavailable``), or Serve itself is away or
        replacing replicas (an outage: retried without counting, exit 75)."""
        state = self._app_state()
        if state is not None and state not in ("RUNNING", "DEPLOYING"):
            return self._unavailable(exc)
        return InfraUnavailableError(f"Ray Serve did not serve {self.app}: {exc}"[:2000])

    def _call(
        self,
        method: str,
        *args: Any,
        timeout_s: float,
        patient: bool = False,
        stop: threading.Event | None = None,
    ) -> Any:
        """Call ``method`` on a replica. ``patient``: wait beyond ``timeout_s`` for as long as Serve
        reports the model's application running (the call is waiting its turn, not lost). ``stop``: once
        set, the call is cancelled (the replica drops its requests) and raises
        :class:`~llmbatch.ray_job.errors.CallAbandonedError`."""
        from ray import exceptions as ray_exceptions
        from ray.serve.exceptions import DeploymentUnavailableError, RayServeException

        try:
            response = getattr(self._handle, method).remote(*args)
            end = time.monotonic() + timeout_s
            while True:
                if stop is not None and stop.is_set():
                    response.cancel()
                    raise CallAbandonedError(f"the call to {self.app} was cancelled by its caller")
                left = end - time.monotonic()
                try:
                    return response.result(timeout_s=max(0.0, min(left, STOP_POLL_S) if stop else left))
                except TimeoutError:
                    if time.monotonic() < end:
                        continue
                    if not (patient and self._alive()):
                        raise
                    end = time.monotonic() + timeout_s
        except TimeoutError as exc:
            raise EngineUnavailableError(
                f"no engine of {self.app} answered within {timeout_s:.0f} s"
            ) from exc
        except KeyError as exc:  # no such application: the model is not deployed
            raise self._unavailable(exc) from exc
        except (DeploymentUnavailableError, RayServeException) as exc:
            raise self._serve_fault(exc) from exc
        except ray_exceptions.RayTaskError as exc:
            if isinstance(exc, EngineDeadError) or isinstance(getattr(exc, "cause", None), EngineDeadError):
                raise EngineDeadError(str(exc)[:2000]) from exc
            raise

    def generate(
        self,
        requests: list[GenRequest],
        *,
        group: str = "",
        priority: int = DEFAULT_PRIORITY,
        due: float | None = None,
        stop: threading.Event | None = None,
    ) -> list[Generation]:
        """Results in the order of ``requests``; ``group`` (the batch), ``priority`` and ``due`` (its
        deadline while it is urgent) decide their turn on the engine; ``stop``: once set, the call is
        cancelled and its requests leave the engine (:class:`~llmbatch.ray_job.errors.CallAbandonedError`)."""
        from ray import exceptions as ray_exceptions

        if not requests:
            return []
        last: BaseException | None = None
        for attempt in range(self._retries + 1):
            try:
                # a call may wait its turn behind higher-priority batches for as long as they run
                out: list[Generation] = self._call(
                    "generate",
                    requests,
                    group,
                    priority,
                    due,
                    timeout_s=self._wait_s,
                    patient=True,
                    stop=stop,
                )
                return out
            except (ray_exceptions.RayActorError, EngineDeadError) as exc:
                last = exc
                log.warning(
                    "engine replica of %s lost during a call (try %d of %d): %s",
                    self.app,
                    attempt + 1,
                    self._retries + 1,
                    str(exc)[:300],
                )
                time.sleep(min(2.0**attempt, 10.0))
        message = f"the engine failed {self._retries + 1} times on these requests: {last!r}"[:1000]
        return [Generation(r.key, failure=RequestFailure(ENGINE_ERROR, message, None, 500)) for r in requests]
