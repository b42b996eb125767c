"""The shared vocabulary of every stage: roles, graph metadata keys, symbolic sizes, folded
constants. Imports nothing else of the package."""
