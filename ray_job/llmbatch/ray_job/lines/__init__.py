"""A request line's data on its way through the job, pure (no I/O, no engine): input lines parsed into
rows, the one row schema, the records an engine takes and gives back, sampling arguments, and the
OpenAI output and error lines."""
