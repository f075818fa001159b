"""sg-opt: makes sparse-model training faster without changing what it computes, and proves both."""

__version__ = "0.1.0"
