"""Tables: where Engram rows live and how they are read (paper section 2.5, spec section 4).

store (the TableStore and SplitLookup protocols and MemoryTable, the in-memory oracle), tablefile
(the on-disk format), tiers (memory-mapped file, pinned host memory, a pool shared by processes),
pool (a DAX/CXL region), mooncake (an RDMA store), sharded (rows across ranks), cache (hot rows),
prefetch (background gathers once a batch's ids are known), hotcold (Engram-Nine's two-part table
sets), registry (every tier a user can choose, by name). A new tier implements TableStore here
and is registered in registry, which offers it everywhere and tests it row for row against
MemoryTable.
"""
