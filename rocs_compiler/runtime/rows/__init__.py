"""Rows of a replicated call: the requests found among consecutive equal request rows."""
