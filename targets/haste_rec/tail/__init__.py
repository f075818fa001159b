"""The HASTE output layer: dense head, group-shared sparse tail, label grouping, tail slots and Triton kernels."""
