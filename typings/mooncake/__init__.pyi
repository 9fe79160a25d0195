# Stubs for the parts of the ``mooncake`` package kvcore uses (pybind11 modules ship no hints).
