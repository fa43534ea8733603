"""CUDA sources of the decode megakernel and their CuPy launchers."""
