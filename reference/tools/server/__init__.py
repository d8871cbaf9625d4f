"""llama.cpp's server (``tools/server``) as semantics: slots on one Context, the scheduler's
step that batches them, prompt reuse, checkpoints, stop strings and the RAM prompt cache.

Everything that decides *what is decoded* lives here, so both twins serve the same way; it
owns no thread, queue or lock and knows no HTTP. The runtime that drives the scheduler (its
thread, inbox and counters) and the HTTP surface live in ``llamaref/server/``.
"""
