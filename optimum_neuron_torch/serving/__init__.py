"""An OpenAI-compatible server on the compiled graphs: in-flight batching over decode slots
(`engine`), the HTTP routes (`app`)."""
