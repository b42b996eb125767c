"""The ``rocs`` command line (``main.py``): inspect, zoo, bench, measure."""
