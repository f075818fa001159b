"""Caches: the device caches of table rows over host tables (SparseGear's device level) and the on-disk build cache."""
