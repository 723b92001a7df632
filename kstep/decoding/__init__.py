"""Decoders: the only place the AR and diffusion paths differ."""
