"""Custom kernels: the provider contract, the one patch point for mlx-lm models, and the Metal/CUDA kernel builds.

Entry point for the rest of mlxinfer: ``from mlxinfer.kernels.patch import apply_kernels``.
"""
