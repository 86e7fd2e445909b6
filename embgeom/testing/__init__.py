"""What the tests and the benchmarks share, and nothing of the product needs.

- :mod:`embgeom.testing.serve`: ``embgeom serve`` / ``embgeom worker`` as child processes
  that die with their parent, and the one bounded wait for ``/readyz``;
- :mod:`embgeom.testing.redis`: a private ``redis-server`` on a free port in a folder;
- :mod:`embgeom.testing.models`: random-weight GPT-2 models built on the spot, and the
  shapes of the packaged models;
- :mod:`embgeom.testing.reference`: the float64 two-pass reference over raw hidden states,
  with its tolerance.

The product never imports this package, and it imports neither ``tests`` nor
``benchmarks`` (``tests/test_import_graph.py``). Nothing is imported here: each module
pulls in only what it uses (the reference needs torch, the serve helper does not).
"""
