"""The C++ kernels (``csrc/``: plain-row sampling and CPU decode attention) and their one
loader, ``cpu_kernels``, which builds them for this machine, keys the build and registers
the ops with torch. Nothing here imports the rest of the scheduler.
"""
