"""The serving engine: continuous batching of diffusion and AR requests over one model runner."""
