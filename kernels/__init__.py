"""The decode megakernel: CUDA sources (*.cu, *.cuh), the plan of a build (plan.py, tuning.py), its NVRTC build and
cache (build.py), the host runtime (runtime.py), its test hooks and diagnostics (diagnostics.py) and the engine
back end (backend.py). Importing this package needs neither CUDA nor CuPy."""
