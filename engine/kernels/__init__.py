"""GPU kernels of the engine (Pallas)."""
