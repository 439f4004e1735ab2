"""Case generators shared by the CPU tests, the GPU tests and the GPU benchmarks.

In the package (not under tests/) so that all three draw cases the same way; imports no Triton.
"""
