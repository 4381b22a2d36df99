"""Runnable examples and the local assets they need (see docs/3d_parallel.md)."""
