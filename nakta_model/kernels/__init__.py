"""Triton kernels, one file per operation (see ../shared/DESIGN.md, "Kernel files")."""
