"""llamaref, the application: the ``llamaref`` command, its backends, ``bench`` and ``verify``.

The top layer of three. ``reference/`` is the specification (NumPy, imports nothing of ours);
``accelerated/`` is its MLX twin (imports ``reference/`` only); this package parses flags,
picks a backend, and prints. Decoding semantics (the generation loop, scheduling, scoring)
live in ``reference/``, written against the Context protocol, so both twins run them.
"""

from reference import __version__

__all__ = ["__version__"]
