"""The `llmbatch` command: each group lives beside the code it drives.

- ``llmbatch submit|cancel|watch|results`` — producer/llmbatch/producer/cli.py (upstream services, humans)
- ``llmbatch dispatcher run``                — dispatcher/llmbatch/dispatcher/cli.py (the service)
- ``llmbatch jobs list|get|cancel``          — dispatcher/llmbatch/dispatcher/ops/jobs_cli.py (operators)
- ``llmbatch dlq list|inspect|replay``       — dispatcher/llmbatch/dispatcher/ops/dlq_cli.py (operators)
- ``llmbatch engines list|deploy|scale|stop`` — dispatcher/llmbatch/dispatcher/ops/engines_cli.py (operators)
- ``llmbatch stack prepare|up|down|status|env|dispatcher`` — llmbatch/stack/cli.py (the local stack)
- ``llmbatch api``                           — api/llmbatch/api/__main__.py (the OpenAI-compatible HTTP API)
- ``llmbatch retention collect|pending``     — api/llmbatch/api/retention/cli.py (expired files and results)
"""

from __future__ import annotations

import typer

from llmbatch.api.retention.cli import app as retention_app
from llmbatch.dispatcher.cli import app as dispatcher_app
from llmbatch.dispatcher.ops.dlq_cli import app as dlq_app
from llmbatch.dispatcher.ops.engines_cli import app as engines_app
from llmbatch.dispatcher.ops.jobs_cli import app as jobs_app
from llmbatch.dispatcher.ops.usage_cli import app as usage_app
from llmbatch.dispatcher.ops.webhooks_cli import app as webhooks_app
from llmbatch.producer.cli import register as register_producer
from llmbatch.stack.cli import app as stack_app

app = typer.Typer(
    help="llmbatch: Kafka-native LLM batch inference on Ray + vLLM.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
register_producer(app)
app.add_typer(dispatcher_app, name="dispatcher")
app.add_typer(stack_app, name="stack")
app.add_typer(jobs_app, name="jobs")
app.add_typer(dlq_app, name="dlq")
app.add_typer(engines_app, name="engines")
app.add_typer(webhooks_app, name="webhooks")
app.add_typer(usage_app, name="usage")
app.add_typer(retention_app, name="retention")


@app.command(
    "api", add_help_option=False, context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
def api_command(ctx: typer.Context) -> None:
    """Serve the OpenAI-compatible HTTP API (Files and Batches); `llmbatch api --help` for options."""
    from llmbatch.api.__main__ import main as api_main

    raise typer.Exit(api_main(ctx.args))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
