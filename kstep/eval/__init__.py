"""Quality measures for completions (used by `kstep bench decode` now, `kstep eval` later)."""
