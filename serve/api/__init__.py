"""The OpenAI-compatible HTTP API: one module per group of routes, assembled by serve/server.py.

* common.py: what every route shares (`ApiContext`: engine, tokenizer, limits, submit / wait /
  stream a request's events) and the error envelope;
* formatting.py: OpenAI response, chunk, logprob and echo formatting and the SSE encoding;
* completions.py, chat.py, models.py (models + adapter admin), ops.py (health, metrics): the routes.
"""
