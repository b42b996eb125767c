"""The straight-line program a compiled graph runs as: direct op calls, in-place reuse, lowerings."""
