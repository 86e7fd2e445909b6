"""Benchmarks of embgeom (``make bench``; ``benchmarks/gpu.sh`` on one GPU). Not part of
the installed library: they drive it from outside, as a user would."""
