"""Twin of [`reference`][reference] on MLX, for speed on Apple silicon (and MLX's CPU device
elsewhere).

The same module paths, public names, parameter names and shapes as ``reference/``; only the
array work lives here. Bookkeeping is imported from ``reference/``, never rewritten.
"""
