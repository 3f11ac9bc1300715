"""An OpenAI-compatible HTTP server over `LLMEngine` (``jax-paged-attn serve MODEL_DIR``).

* `cli`: the command line, loading, warm-up, uvicorn and graceful SIGTERM.
* `app`: the FastAPI routes: ``/v1/completions``, ``/v1/chat/completions``,
  ``/v1/models``, ``/health``, ``/metrics``, ``/tokenize``, ``/detokenize``.
* `async_engine`: the engine thread, admission, per-request streams, aborts.
* `protocol`: OpenAI's request / response shapes and errors.
* `detokenizer`: incremental text and stop strings for streaming.
* `chat_template`: the checkpoint's chat template, rendered as transformers does.
* `metrics`: the Prometheus metrics.

FastAPI and uvicorn are an optional extra (``pip install 'jax-paged-attn[serve]'``);
only `cli` and `app` import them, when they run.
"""
