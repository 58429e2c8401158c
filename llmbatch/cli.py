"""The `llmbatch` command: each group lives beside the code it drives."""

from __future__ import annotations

import typer

from llmbatch.stack.cli import app as stack_app

app = typer.Typer(help="llmbatch: Kafka-native LLM batch inference on Ray + vLLM.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
app.add_typer(stack_app, name="stack")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
