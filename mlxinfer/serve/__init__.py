"""``mlxinfer serve``: an OpenAI-compatible HTTP server over the engine (see docs/serve.md).

app.py (routes, OpenAI response shapes), schemas.py (request validation), scheduler.py (continuous batching),
prefill.py (prompts prefilled in rounds between decode steps), prefix_cache.py, sequence.py (one request in the
engine), metrics.py (Prometheus), runner.py (uvicorn, bind checks, graceful drain).
"""
