"""Rewrite passes, one module each. Every pass is a function GraphModule -> GraphModule."""
