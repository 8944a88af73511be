"""Tables: where Engram rows live and how they are read (paper section 2.5, spec section 4).

store (the TableStore protocol and MemoryTable, the in-memory oracle), tablefile (the on-disk
format), tiers (memory-mapped file, pinned host memory, a pool shared by processes), cache (hot
rows), prefetch (background gathers once a batch's ids are known), sharded (rows across ranks).
A new tier implements TableStore here and is tested row for row against MemoryTable.
"""
