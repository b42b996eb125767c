"""The straight-line program a graph runs as: direct op calls, in-place reuse, lowerings."""
