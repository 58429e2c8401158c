"""The backend the dispatcher runs its batches on, built from its settings: Ray Jobs (one job per batch,
with S3 sessions handed to their drivers when ``job.s3_sessions`` is on), behind the shared engines'
short path when that is on (small batches go to the batch runner on the Serve engines).

The backends' modules are imported only when built: the runner's brings Ray, which the plain job path
never needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmbatch.dispatcher.backends.backend import JobBackend
from llmbatch.dispatcher.backends.input_sizes import SizeOf
from llmbatch.dispatcher.settings import DispatcherSettings
from llmbatch.dispatcher.state.store import StateStore

if TYPE_CHECKING:
    from llmbatch.dispatcher.backends.ray_backend import SpecUploader
    from llmbatch.dispatcher.backends.runner_backend import RunnerClient


def build_backend(
    settings: DispatcherSettings, store: StateStore, *, upload_spec: SpecUploader, input_sizes: SizeOf
) -> tuple[JobBackend, RunnerClient | None]:
    """The job backend of ``settings`` and, with the short path on (``shared_engines`` and
    ``short_path_max_lines`` > 0), the batch runner's client it routes small batches to (else None).
    ``upload_spec`` uploads a job's spec; ``input_sizes`` is the size cache the tracker's admission
    shares, so the route a batch was admitted for is the route it is submitted on."""
    from llmbatch.dispatcher.backends.ray_backend import RayJobsBackend

    opts = settings.dispatcher
    job_sessions = None
    if settings.job.s3_sessions:
        from llmbatch.dispatcher.backends.s3_sessions import JobSessions, SessionMinter

        job_sessions = JobSessions(
            SessionMinter(
                settings.s3, duration_s=settings.job.s3_session_s, role_arn=opts.runner_s3_role_arn
            ),
            store,
        )
    backend: JobBackend = RayJobsBackend(settings, upload_spec=upload_spec, sessions=job_sessions)
    runner: RunnerClient | None = None
    if opts.shared_engines and opts.short_path_max_lines > 0:
        # imported here: the runner's module brings Ray, which the plain job path never needs
        from llmbatch.dispatcher.backends.runner_backend import RoutedBackend, RunnerClient
        from llmbatch.dispatcher.backends.s3_sessions import SessionMinter

        sessions = None
        if opts.runner_s3_sessions:
            sessions = SessionMinter(
                settings.s3, duration_s=opts.runner_s3_session_s, role_arn=opts.runner_s3_role_arn
            )
        runner = RunnerClient.of(settings.ray, sessions=sessions)
        backend = RoutedBackend(
            backend,
            runner,
            max_lines=opts.short_path_max_lines,
            max_bytes=opts.short_path_max_bytes,
            size_of=input_sizes,
        )
    return backend, runner
