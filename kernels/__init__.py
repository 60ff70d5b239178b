"""Kernels (Triton, fbgemm glue) used by graphshard's sharded embedding passes."""
