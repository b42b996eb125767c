"""Analysis: the per-op rule registry, the driver that writes roles into a graph, the batch
axis, segment (lane) analysis and FLOP counting."""
