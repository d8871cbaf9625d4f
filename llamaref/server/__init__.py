"""``llamaref serve``: llama.cpp's server over HTTP; the scheduler is ``reference.tools.server``,
the runtime that drives it (its thread, inbox and counters) is ``llamaref.server.engine``."""
