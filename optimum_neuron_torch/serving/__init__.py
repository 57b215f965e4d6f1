"""An OpenAI-compatible server over the generation engine (`generation.engine`): the request and
error bodies (`protocol`), the HTTP routes (`app`), uvicorn (`server`)."""
