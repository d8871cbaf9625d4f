"""llama.cpp's server (``tools/server``) as semantics: slots on one Context, the decode loop
that batches them, prompt reuse, checkpoints, stop strings and the RAM prompt cache.

The HTTP surface lives in ``llamaref/server/``; everything that decides *what is decoded*
lives here, so both twins serve the same way.
"""
