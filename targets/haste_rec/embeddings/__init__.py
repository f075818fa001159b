"""The embedding tables: where their rows live, how they are pooled and updated, their kernel slots and kernels."""
