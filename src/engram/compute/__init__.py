"""The compute choices every layer shares: ``gemm`` (float32 CPU matrix products through oneDNN or
torch, the route measured per shape) with ``gemm_decisions`` (where the measured routes are kept
between processes), ``machine`` (the processor every timing and result names) and ``jit`` (numba's
decorator for the compiled CPU kernels).

A foundation: imports only files of engram. Empty on purpose: ``machine`` loads without torch and
``jit`` without numba only if this file imports neither; import the modules by name
(``from engram.compute import gemm``)."""
