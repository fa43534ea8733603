"""The decode megakernel: CUDA sources (*.cu, *.cuh), their NVRTC build and cache (build.py), the host runtime
(runtime.py) and the engine back end (backend.py). Importing this package needs neither CUDA nor CuPy."""
