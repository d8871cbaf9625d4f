"""llamaref's specification: LLM inference as llama.cpp does it, in plain NumPy.

Every array operation here is readable NumPy; every piece of bookkeeping (KV cells, batches,
return codes) is plain Python. ``accelerated/`` is the MLX twin of the array work and imports
the bookkeeping from here.
"""

__version__ = "0.1.0"
