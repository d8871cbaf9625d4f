"""``llamaref serve``: llama.cpp's server over HTTP (the engine is ``reference.tools.server``)."""
