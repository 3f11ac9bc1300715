"""An OpenAI-compatible HTTP server over `LLMEngine` (``jax-paged-attn serve MODEL_DIR``).

* `cli`: the command line, loading, warm-up, uvicorn and graceful SIGTERM.
* `app`: the FastAPI routes: ``/v1/completions``, ``/v1/chat/completions``,
  ``/v1/models``, ``/health``, ``/metrics``, ``/tokenize``, ``/detokenize``.
* `async_engine`: the front end: admission, per-request streams, aborts, metrics.
* `engine_core`: where the engine loop runs: a thread of the server, or a process of its
  own (``--engine-core process``), and the JSON between them.
* `engine_process`: spawns that process before the server imports JAX (standard library only).
* `engine_loop`: the engine's side: its requests, their text, each step's events.
* `protocol`: OpenAI's request / response shapes and errors.
* `detokenizer`: incremental text and stop strings for streaming.
* `chat_template`: the checkpoint's chat template, rendered as transformers does.
* `metrics`: the Prometheus metrics.

FastAPI and uvicorn are an optional extra (``pip install 'jax-paged-attn[serve]'``);
only `cli` and `app` import them, when they run.
"""
